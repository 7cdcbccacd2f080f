// A decoding step's decoder layers in one call: the fast layers' fused path (selfspec/models/fast.py,
// FastLayer.forward_segments for one causal sequence of at most 16 rows) run from C++, so the ~10 ops of
// each layer pay no Python dispatch between them: on a small model the Python between the kernels is a large
// part of a step (docs/BENCHMARKS.md has the profile).
//
// Same ops, same order, same arguments as the Python path (rms_norm, the packed linears, rope_qkv, attention,
// silu_mul of ops.cpp / attention.cpp / qlinear.cpp / qlinear_i8.cpp / gemv.cpp), so its results are bit for bit the
// Python path's.
//
// One layer, rows = B * n (n new tokens of one sequence):
//   x   = rms_norm(h, input_norm)                        # [B, n, hidden]
//   qkv = x @ Wqkv^T (+ bias)                             # [B, n, (hq + 2 hkv) d]; q / k norms per head if any
//   q   = rope_qkv(qkv, cos, sin) -> k, v into the cache  # [B, n, hq, d]
//   h  += attention(q, cache) @ Wo^T                      # in place (the residual stream)
//   h  += silu_mul(rms_norm(h, post_attention_norm) @ Wgu^T) @ Wdown^T
#include <torch/csrc/utils/pybind.h>  // binds to Python (PYBIND11_MODULE / bind_step)

#include <cmath>
#include <cstdlib>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// One kernel call of a packed linear: output columns [a, b) of y.
struct Part {
  int64_t kind;  // 0: block-quantized (qlinear), 1: the same in the int8 mode (qlinear_i8), 2: float32 (gemv linear)
  at::Tensor codes, scales, offsets;  // kind 2: codes is the packed weight [N / 8, K, 8], the others unused
  int64_t bits, group;
  double z;
  at::Tensor bias;  // [b - a] or empty
  int64_t a, b;
  raw::QWeight w{};      // kinds 0 and 1: the weight's pointers (checked once, by make_linear)
  int64_t K = 0;         // input columns
  const float* bias_p = nullptr;
};

// A PackedLinear (selfspec/kernels/linear.py) as its kernel calls, in order.
struct Linear {
  std::vector<Part> parts;
  int64_t out_features;

  int64_t in_features() const { return parts[0].K; }

  // y [rows, out_features] (row stride ldy; a float32 part needs ldy == out_features) = or += x [rows, in_features]
  // (contiguous) @ W^T (+ bias): the raw cores of the kernels PackedLinear calls from Python, with the same
  // arguments, so bit for bit its results.
  void apply(const float* x, int64_t rows, float* y, int64_t ldy, bool accumulate) const {
    for (const Part& p : parts) {
      if (p.kind == 2)
        raw::linear(x, rows, p.K, p.codes.data_ptr<float>(), p.codes.size(0), p.bias_p, y, out_features, accumulate);
      else if (p.kind == 1)
        raw::qlinear_i8(x, rows, p.w, p.bias_p, y + p.a, ldy, p.b - p.a, accumulate);
      else
        raw::qlinear(x, rows, p.w, p.bias_p, y + p.a, ldy, p.b - p.a, accumulate);
    }
  }
};

// This thread's scratch memory, 64-byte aligned, kept between calls so that a step allocates nothing per layer: a
// layer's intermediate rows (tens of KB for a step's few rows) or the LM head's logits (up to 16 rows of the
// vocabulary: ~10 MB on Qwen2.5). Growing it frees the old buffer, so a caller holds no pointer across two calls.
float* scratch(size_t floats) {
  struct Buffer {
    float* p = nullptr;
    size_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  if (floats > buf.n) {
    const size_t n = (floats + 1023) / 1024 * 1024;
    float* p = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
    TORCH_CHECK(p, "out of memory for a step's scratch rows (", n * sizeof(float), " bytes)");
    std::free(buf.p);
    buf.p = p;
    buf.n = n;
  }
  return buf.p;
}

inline int64_t padded(int64_t floats) { return (floats + 15) / 16 * 16; }  // a 64-byte multiple

// One sequence's rows in a layer call over several sequences: rows [offset, offset + n) of the block, their
// rotary rows [B, n, rot], this layer's cache buffers of that sequence and its length before the call.
struct Segment {
  int64_t offset, n;
  at::Tensor cos, sin, keys, values;
  int64_t start;
};

struct LayerPlan {
  Linear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm, k_norm: empty unless the layer has them
  double input_eps, post_eps, q_eps, k_eps;
  int64_t hq, hkv, head_dim, window;
  double scaling;

  // h [B, n, hidden] (contiguous, updated in place); keys / values [B, hkv, capacity, d] this layer's cache,
  // entries [start, start + n) written here; cos / sin [B, n, rot] contiguous.
  void forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
               const at::Tensor& values, int64_t start) const {
    forward_segments(h, {Segment{0, h.size(1), cos, sin, keys, values, start}});
  }

  // The layer over the rows of several sequences at once (``FastLayer.forward_segments``): h [B, R, hidden] holds
  // each segment's rows [offset, offset + n) (B = 1 with several segments), each attending to its own cache; the
  // norms and linears run over all rows, rotary + cache write and attention per segment. The kernels on raw
  // pointers with the intermediate rows in this thread's scratch (no tensor made): the same calls, in the same
  // order and with the same arguments as the tensor functions, so bit for bit their results.
  void forward_segments(const at::Tensor& h, const std::vector<Segment>& segs) const {
    const int64_t B = h.size(0), R = h.size(1), hidden = h.size(2), rows = B * R, d = head_dim;
    const int64_t inter = gate_up.out_features / 2;
    const int64_t W = qkv.out_features;  // (hq + 2 hkv) d
    TORCH_CHECK(h.dim() == 3 && h.is_contiguous() && h.scalar_type() == at::kFloat && rows >= 1 && rows <= 16 &&
                    hidden == qkv.in_features(),
                "h: [B, n, hidden] float32 contiguous, 1-16 rows");
    TORCH_CHECK(!segs.empty() && (B == 1 || segs.size() == 1), "segments of one row block (B = 1 with several)");
    int64_t covered = 0;
    for (const Segment& g : segs) {
      const int64_t cap = g.keys.size(2), rot = g.cos.size(-1);
      TORCH_CHECK(g.offset == covered && g.n >= 1, "segments cover the rows in order");
      covered += g.n;
      TORCH_CHECK(g.keys.dim() == 4 && g.keys.size(0) == B && g.keys.size(1) == hkv && g.keys.size(3) == d &&
                      g.keys.is_contiguous() && g.values.sizes() == g.keys.sizes() && g.values.is_contiguous() &&
                      g.keys.scalar_type() == at::kFloat && g.values.scalar_type() == at::kFloat,
                  "keys, values: [B, hkv, capacity, head_dim] float32 contiguous");
      TORCH_CHECK(g.start >= 0 && g.start + g.n <= cap, "cache too small");
      TORCH_CHECK(g.cos.is_contiguous() && g.sin.is_contiguous() && g.cos.scalar_type() == at::kFloat &&
                      g.sin.sizes() == g.cos.sizes() && g.sin.scalar_type() == at::kFloat &&
                      g.cos.numel() == B * g.n * rot && rot <= d,
                  "cos, sin: [B, n, rot] float32 contiguous");
    }
    TORCH_CHECK(covered == R, "segments cover the rows");
    float* hp = h.data_ptr<float>();
    float* x = scratch(padded(rows * hidden) + padded(rows * W) + 2 * padded(rows * hq * d) +
                       padded(rows * 2 * inter) + padded(rows * inter));
    float* y = x + padded(rows * hidden);
    float* q = y + padded(rows * W);
    float* a = q + padded(rows * hq * d);
    float* gu = a + padded(rows * hq * d);
    float* act = gu + padded(rows * 2 * inter);
    raw::rms_norm(hp, input_norm.data_ptr<float>(), x, rows, hidden, input_eps);
    qkv.apply(x, rows, y, W, false);
    if (q_norm.numel()) {  // Qwen3: per-head norms of q and k before rotary (as FastLayer._qkv), in place
      for (int64_t r = 0; r < rows; ++r) {
        raw::rms_norm(y + r * W, q_norm.data_ptr<float>(), y + r * W, hq, d, q_eps);
        raw::rms_norm(y + r * W + hq * d, k_norm.data_ptr<float>(), y + r * W + hq * d, hkv, d, k_eps);
      }
    }
    for (const Segment& g : segs) {  // each sequence's rotary, cache write and attention over its own cache
      const int64_t cap = g.keys.size(2), rot = g.cos.size(-1), at = g.offset;
      raw::rope_qkv(y + at * W, g.cos.data_ptr<float>(), g.sin.data_ptr<float>(), q + at * hq * d,
                    g.keys.data_ptr<float>(), g.values.data_ptr<float>(), B, g.n, hq, hkv, d, cap, g.start, rot);
      raw::attention(q + at * hq * d, g.keys.data_ptr<float>(), g.values.data_ptr<float>(), a + at * hq * d, B,
                     g.n, hq, d, hkv, cap, g.start, window, scaling);
    }
    o.apply(a, rows, hp, hidden, true);
    raw::rms_norm(hp, post_norm.data_ptr<float>(), x, rows, hidden, post_eps);
    gate_up.apply(x, rows, gu, 2 * inter, false);
    raw::silu_mul(gu, act, rows, inter);
    down.apply(act, rows, hp, hidden, true);
  }
};

Linear make_linear(std::vector<Part> parts, int64_t out_features) {
  TORCH_CHECK(!parts.empty(), "a linear needs its parts");
  for (Part& p : parts) {
    TORCH_CHECK(p.kind >= 0 && p.kind <= 2, "part kind must be 0, 1 or 2");
    TORCH_CHECK(p.kind != 2 || (parts.size() == 1 && p.a == 0 && p.b == out_features),
                "a float32 part must be the linear's only one");
    TORCH_CHECK(0 <= p.a && p.a < p.b && p.b <= out_features, "part columns out of range");
    TORCH_CHECK(p.bias.numel() == 0 || (p.bias.numel() == p.b - p.a && p.bias.is_contiguous() &&
                                        p.bias.scalar_type() == at::kFloat),
                "bias: [b - a] float32 or empty");
    p.bias_p = p.bias.numel() ? p.bias.data_ptr<float>() : nullptr;
    if (p.kind == 2) {
      TORCH_CHECK(p.codes.dim() == 3 && p.codes.size(2) == 8 && p.codes.is_contiguous() &&
                      p.codes.scalar_type() == at::kFloat && p.codes.size(1) % 4 == 0 &&
                      out_features <= p.codes.size(0) * 8,
                  "a float32 part's packed weight: [N / 8, K, 8] float32, K % 4 == 0");
      p.K = p.codes.size(1);
    } else {
      p.w = raw::qweight(p.codes, p.scales, p.offsets, p.bits, p.group, p.z);
      TORCH_CHECK(p.b - p.a <= p.w.NB * 16 && p.b - p.a > (p.w.NB - 1) * 16, "a part's columns fill its blocks");
      p.K = p.w.G * p.w.group;
    }
    TORCH_CHECK(p.K == parts[0].K || &p == &parts[0], "every part of a linear reads the same input width");
  }
  return Linear{std::move(parts), out_features};
}

// The final norm, the LM head and each row's argmax: a greedy step's tail (``SplitModel.greedy_ids`` for the rows
// the LM head's screen does not take), bit for bit rms_norm, the packed LM head and argmax_rows. Between kernels a
// step's Python runs with cold caches (the step has just streamed the weights through them), so the same three as
// torch calls cost far more than their arithmetic.
struct ArgmaxHead {
  at::Tensor norm;
  double eps;
  Linear lm;
};

// ids [rows] of h [rows, hidden] float32 contiguous, the norm's rows and the logits in this thread's scratch.
void argmax_ids(const ArgmaxHead& g, const float* h, int64_t rows, int64_t* ids) {
  const int64_t hidden = g.norm.numel(), V = g.lm.out_features;
  float* x = scratch(padded(rows * hidden) + rows * V);
  float* logits = x + padded(rows * hidden);
  raw::rms_norm(h, g.norm.data_ptr<float>(), x, rows, hidden, g.eps);
  g.lm.apply(x, rows, logits, V, false);
  raw::argmax_rows(logits, rows, V, ids);
}

// The one compiled plan of a causal step (selfspec/models/plans.py, ``StepPlans``): a range of decoder layers (a
// model's, a head's block, or one layer), optionally fed by an embedding lookup and followed by the final norm, LM
// head and argmax. Every compiled step is a call of it: a plain greedy step (the token's embedding row, every layer,
// the argmax), a round that drafts nothing keeping the exit state (a tap), a draft's or a verification block's
// layers, the argmax of a block's rows (no layers), one fast layer, a head's block.
struct StepPlan {
  std::vector<std::shared_ptr<LayerPlan>> layers;
  std::vector<int64_t> kinds;  // per layer: the index of its rotary table (Gemma 3: one per attention kind)
  int64_t embed_kind;          // -1: none (rows come in as states), 0: block-quantized rows, 2: a float32 table
  at::Tensor codes, scales, offsets;  // embed_kind 2: codes is the table [vocab, hidden], the others unused
  int64_t bits, group;
  double z;
  int64_t vocab;
  std::shared_ptr<ArgmaxHead> head;  // null: no argmax
  int64_t hidden;                    // the rows' width
};

// Per layer of [a, b), its rotary kind's rows [B, n, rot] at ``position`` of the tables ``cos``, ``sin`` (per kind
// [B, >= position + n, rot]: a table of positions 0, 1, ... or a call's own rows at position 0).
void rotary_rows(const StepPlan& p, int64_t a, int64_t b, int64_t position, int64_t n,
                 const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, std::vector<at::Tensor>& c,
                 std::vector<at::Tensor>& s) {
  std::vector<at::Tensor> cos_at, sin_at;
  for (size_t k = 0; k < cos.size(); ++k) {
    TORCH_CHECK(cos[k].dim() == 3 && position >= 0 && cos[k].size(1) >= position + n &&
                    sin[k].sizes() == cos[k].sizes(),
                "rotary tables [B, >= position + n, rot]");
    cos_at.push_back(cos[k].narrow(1, position, n));
    sin_at.push_back(sin[k].narrow(1, position, n));
  }
  c.resize(b - a);
  s.resize(b - a);
  for (int64_t i = a; i < b; ++i) {
    const int64_t kind = p.kinds[i];
    TORCH_CHECK(kind < static_cast<int64_t>(cos.size()), "one cos and one sin table per rotary kind");
    c[i - a] = cos_at[kind];
    s[i - a] = sin_at[kind];
  }
}

// The token's embedding row [1, 1, hidden] (a quantized table's row dequantized, or a float32 table's copied).
at::Tensor embed_row(const StepPlan& p, int64_t token) {
  const int64_t hidden = p.hidden;
  TORCH_CHECK(p.embed_kind >= 0, "this plan has no embedding: pass the rows");
  TORCH_CHECK(0 <= token && token < p.vocab, "token id ", token, " out of range [0, ", p.vocab, ")");
  at::Tensor h = at::empty({1, 1, hidden}, at::kFloat);
  if (p.embed_kind == 0)
    qdequant(p.codes, p.scales, p.offsets, p.bits, p.group, p.z, at::full({1}, token, at::kLong), h.view({1, hidden}));
  else
    h.view({hidden}).copy_(p.codes[token]);
  return h;
}

// Layers [a, b) of the plan on h [B, n, hidden] in place; keys / values / starts: layers [a, b)'s cache buffers and
// lengths (index i - a). ``taps``: layers t in [a, b] whose input rows (the states after layers [a, t)) are kept,
// in order, in ``tapped``.
void run_range(const StepPlan& p, const at::Tensor& h, int64_t a, int64_t b, const std::vector<at::Tensor>& c,
               const std::vector<at::Tensor>& s, const std::vector<at::Tensor>& keys,
               const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& taps, std::vector<at::Tensor>& tapped) {
  size_t t = 0;
  for (int64_t i = a; i <= b; ++i) {
    for (; t < taps.size() && taps[t] == i; ++t) tapped.push_back(h.clone());
    if (i < b) p.layers[i]->forward(h, c[i - a], s[i - a], keys[i - a], values[i - a], starts[i - a]);
  }
}

// Layers [a, b) within the plan, one key buffer, value buffer and start per layer of them, taps ascending in [a, b].
void check_range(const StepPlan& p, int64_t a, int64_t b, const std::vector<at::Tensor>& keys,
                 const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& taps) {
  TORCH_CHECK(0 <= a && a <= b && b <= static_cast<int64_t>(p.layers.size()), "layers [", a, ", ", b,
              ") out of the plan's [0, ", p.layers.size(), ")");
  const size_t L = static_cast<size_t>(b - a);
  TORCH_CHECK(keys.size() == L && values.size() == L && starts.size() == L,
              "one cache buffer and start per layer of [a, b)");
  for (size_t t = 0; t < taps.size(); ++t)
    TORCH_CHECK(a <= taps[t] && taps[t] <= b && (t == 0 || taps[t - 1] <= taps[t]), "taps: ascending, in [a, b]");
}

// x: the rows [B, n, hidden] float32 contiguous (updated in place), or, with token >= 0, that token's embedding row
// (n = 1) made here; position: the first row's position in the rotary tables; ``argmax``: then each row's argmax
// through the plan's head. -> (the rows after layer b, the taps' rows, ids [B * n] int64 or an empty tensor)
std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor> run_plan(
    const StepPlan& p, int64_t a, int64_t b, const at::Tensor& x, int64_t token, int64_t position,
    const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts, const std::vector<int64_t>& taps,
    bool argmax) {
  check_range(p, a, b, keys, values, starts, taps);
  const at::Tensor h = token >= 0 ? embed_row(p, token) : x;
  TORCH_CHECK(h.dim() == 3 && h.is_contiguous() && h.scalar_type() == at::kFloat, "rows: [B, n, hidden] float32");
  const int64_t rows = h.size(0) * h.size(1);
  TORCH_CHECK(rows >= 1 && rows <= 16, "a step of 1-16 rows, got ", rows);
  std::vector<at::Tensor> c, s, tapped;
  if (a < b) rotary_rows(p, a, b, position, h.size(1), cos, sin, c, s);
  run_range(p, h, a, b, c, s, keys, values, starts, taps, tapped);
  at::Tensor ids;
  if (argmax) {
    TORCH_CHECK(p.head, "this plan has no argmax head");
    TORCH_CHECK(h.size(2) == p.head->norm.numel(), "rows: the LM head's input width");
    ids = at::empty({rows}, h.options().dtype(at::kLong));
    argmax_ids(*p.head, h.data_ptr<float>(), rows, ids.data_ptr<int64_t>());
  }
  return {h, tapped, ids};
}

// Layers [a, b) of several sequences' causal rows at once (a batched round's stage, ``StepPlans.run_batch``): h
// [1, R, hidden] (updated in place) holds sequence j's rows from offsets[j], ns[j] of them; per sequence, per rotary
// kind its cos / sin table [1, >= positions[j] + ns[j], rot] and its first row's position in it, and per layer of
// [a, b) its cache buffers and length (index [j][i - a]). Every weight is read once for all rows, each sequence
// attends to its own cache: bit for bit the per-op path's ``forward_segments``.
void run_segments(const StepPlan& p, int64_t a, int64_t b, const at::Tensor& h, const std::vector<int64_t>& offsets,
                  const std::vector<int64_t>& ns, const std::vector<std::vector<at::Tensor>>& cos,
                  const std::vector<std::vector<at::Tensor>>& sin, const std::vector<int64_t>& positions,
                  const std::vector<std::vector<at::Tensor>>& keys, const std::vector<std::vector<at::Tensor>>& values,
                  const std::vector<std::vector<int64_t>>& starts) {
  const size_t S = offsets.size();
  TORCH_CHECK(S >= 1 && ns.size() == S && cos.size() == S && sin.size() == S && positions.size() == S &&
                  keys.size() == S && values.size() == S && starts.size() == S,
              "per sequence its offset, rows, rotary tables, position and caches");
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1, "rows: [1, R, hidden]");
  std::vector<std::vector<at::Tensor>> c(S), s(S);
  for (size_t j = 0; j < S; ++j) {
    check_range(p, a, b, keys[j], values[j], starts[j], {});
    rotary_rows(p, a, b, positions[j], ns[j], cos[j], sin[j], c[j], s[j]);
  }
  std::vector<Segment> segs(S);
  for (int64_t i = a; i < b; ++i) {
    for (size_t j = 0; j < S; ++j)
      segs[j] = Segment{offsets[j], ns[j], c[j][i - a], s[j][i - a], keys[j][i - a], values[j][i - a],
                        starts[j][i - a]};
    p.layers[i]->forward_segments(h, segs);
  }
}

// A deep head's draft step (selfspec/heads/deep.py, ``DeepContextHead.draft_step``): ``features`` and
// ``logits_part_of`` of a drafted token in one call, the same ops in the same order as the Python path, so its
// results are bit for bit that path's (tested). Per call the Python path ran ~40 small ops around these kernels,
// a large part of a head call's time.
//   x      = rms_norm(h, norm_h) ++ rms_norm(ctx, norm_f)   # [n, 2 hidden]
//   f^     = block(x @ Wfuse^T)                             # [1, n, hidden], each layer appending to its cache
//   logits = rms_norm(f^[-1], norm_out) @ Wpart^T           # [1, V'] the drafted vocabulary's rows
struct HeadPlan {
  at::Tensor norm_h, norm_f, norm_out;
  double eps_h, eps_f, eps_out;
  Linear fuse, lm;
  StepPlan block;  // the head's decoder layers (one rotary kind, no embedding, no argmax)
};

// h, ctx [1, n, hidden] float32 contiguous (exit states, the previous positions' final states); cos, sin: the rows'
// rotary [1, n, rot]; per head layer its cache buffers and length. -> {f^ [1, n, hidden], the last row's logits [1, V']}
std::vector<at::Tensor> head_step(const HeadPlan& p, const at::Tensor& h, const at::Tensor& ctx, const at::Tensor& cos,
                                  const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                  const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts) {
  const int64_t L = p.block.layers.size();
  check_range(p.block, 0, L, keys, values, starts, {});
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1 && h.is_contiguous() && h.scalar_type() == at::kFloat,
              "h: [1, n, hidden] float32 contiguous");
  TORCH_CHECK(ctx.sizes() == h.sizes() && ctx.is_contiguous() && ctx.scalar_type() == at::kFloat,
              "ctx: h's shape, float32 contiguous");
  const int64_t n = h.size(1), hidden = h.size(2);
  TORCH_CHECK(n >= 1 && n <= 16, "a head step of 1-16 rows, got ", n);
  TORCH_CHECK(hidden == p.norm_h.numel(), "h: rows of ", p.norm_h.numel(), ", got ", hidden);
  // x = [rms_norm(h) | rms_norm(ctx)] row by row in this thread's scratch (the layers reuse it after the fuse)
  float* x = scratch(padded(n * 2 * hidden));
  const float *hp = h.data_ptr<float>(), *cp = ctx.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    raw::rms_norm(hp + r * hidden, p.norm_h.data_ptr<float>(), x + r * 2 * hidden, 1, hidden, p.eps_h);
    raw::rms_norm(cp + r * hidden, p.norm_f.data_ptr<float>(), x + r * 2 * hidden + hidden, 1, hidden, p.eps_f);
  }
  at::Tensor f = at::empty({1, n, hidden}, h.options());
  p.fuse.apply(x, n, f.data_ptr<float>(), hidden, false);
  std::vector<at::Tensor> c, s, tapped;
  rotary_rows(p.block, 0, L, 0, n, {cos}, {sin}, c, s);
  run_range(p.block, f, 0, L, c, s, keys, values, starts, {}, tapped);
  float* last = scratch(padded(hidden));
  raw::rms_norm(f.data_ptr<float>() + (n - 1) * hidden, p.norm_out.data_ptr<float>(), last, 1, hidden, p.eps_out);
  at::Tensor logits = at::empty({1, p.lm.out_features}, h.options());
  p.lm.apply(last, 1, logits.data_ptr<float>(), p.lm.out_features, false);
  return {f, logits};
}

// The front of a greedy drafting round with a deep head (``EarlyExitDrafter``'s first draft) and, when that draft
// falls short of the policy's confidence bar (a blank round: the head ran, no draft), the rest of the pending
// token's plain step, in one call (``DeepContextHead.draft_or_step``): the target's plan run in two ranges around the
// head's step, the same calls as the Python path in its order, so the results are bit for bit its own:
//   h      = layers [0, k) of the token's embedding row       # the exit state [1, 1, hidden]
//   f^, z  = head_step([backlog, h], ctx)                     # z: the drafted vocabulary's logits [1, V']
//   conf   = max softmax(z), d = ids[argmax z]                # as Chain._pick
//   conf >= bar: -> the draft d (the caller drafts on from h and f^)
//   else:        layers [k, L) of h, final norm, LM head, argmax -> the target's next token (and its final state)
// Where most rounds are blank (the confidence stop refuses the first draft, as on translation prompts), a blank
// round's cost beyond a plain step is mostly the round's Python, not the head's kernel: one call removes it.
// -> ({exit state, f^ [1, n, hidden], the final state [1, 1, hidden] or an empty tensor}, drafted, token, conf)
std::tuple<std::vector<at::Tensor>, bool, int64_t, double> draft_or_step(
    const StepPlan& p, const HeadPlan& head, int64_t k, int64_t token, int64_t position,
    const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& values, const std::vector<int64_t>& starts,
    const at::Tensor& backlog,  // [1, b, hidden]: exit states the head has not seen yet (b may be 0)
    const at::Tensor& ctx,      // [1, b + 1, hidden]: the final states of the positions before those rows
    const at::Tensor& head_cos, const at::Tensor& head_sin, const std::vector<at::Tensor>& head_keys,
    const std::vector<at::Tensor>& head_values, const std::vector<int64_t>& head_starts,
    const at::Tensor& ids,  // [V'] int64: the drafted vocabulary's token ids
    double bar) {
  const int64_t L = p.layers.size();
  TORCH_CHECK(0 <= k && k <= L, "exit layer ", k, " out of range [0, ", L, "]");
  check_range(p, 0, L, keys, values, starts, {});
  TORCH_CHECK(p.head, "the target's plan needs its argmax head");
  const int64_t hidden = p.head->norm.numel();
  TORCH_CHECK(backlog.dim() == 3 && backlog.size(0) == 1 && backlog.size(2) == hidden &&
                  backlog.scalar_type() == at::kFloat,
              "backlog: [1, b, hidden] float32");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.size(0) == head.lm.out_features,
              "ids: the drafted vocabulary's [V'] int64");
  std::vector<at::Tensor> c, s, tapped;
  rotary_rows(p, 0, L, position, 1, cos, sin, c, s);
  const at::Tensor h = embed_row(p, token);
  run_range(p, h, 0, k, c, s, keys, values, starts, {}, tapped);
  const at::Tensor exit = h.clone();
  const at::Tensor rows = backlog.size(1) ? at::cat({backlog, exit}, 1) : exit;
  const std::vector<at::Tensor> fz = head_step(head, rows, ctx, head_cos, head_sin, head_keys, head_values,
                                               head_starts);
  const at::Tensor z = fz[1][0];  // [V']
  const double conf = at::softmax(z, -1).max().item<double>();
  if ((std::isinf(bar) && bar < 0) || conf >= bar) {  // -inf: a policy that keeps every draft (even a NaN's)
    const int64_t draft = ids[argmax_rows(fz[1]).item<int64_t>()].item<int64_t>();
    return {{exit, fz[0], at::Tensor()}, true, draft, conf};
  }
  // layers [k, L): their slices of the per-layer arguments (run_range indexes them from its first layer)
  const std::vector<at::Tensor> ck(c.begin() + k, c.end()), sk(s.begin() + k, s.end()),
      kk(keys.begin() + k, keys.end()), vk(values.begin() + k, values.end());
  const std::vector<int64_t> stk(starts.begin() + k, starts.end());
  run_range(p, h, k, L, ck, sk, kk, vk, stk, {}, tapped);
  int64_t next;
  argmax_ids(*p.head, h.data_ptr<float>(), 1, &next);
  return {{exit, fz[0], h}, false, next, conf};
}

}  // namespace

void bind_step(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<Part>(m, "Part")
      .def(py::init([](int64_t kind, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                       int64_t group, double z, at::Tensor bias, int64_t a, int64_t b) {
             return Part{kind, codes, scales, offsets, bits, group, z, bias, a, b};
           }),
           py::arg("kind"), py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bits"),
           py::arg("group"), py::arg("z"), py::arg("bias"), py::arg("a"), py::arg("b"));
  py::class_<Linear>(m, "Linear").def(py::init(&make_linear), py::arg("parts"), py::arg("out_features"));
  py::class_<LayerPlan, std::shared_ptr<LayerPlan>>(m, "LayerPlan")
      .def(py::init([](Linear qkv, Linear o, Linear gate_up, Linear down, at::Tensor input_norm, double input_eps,
                       at::Tensor post_norm, double post_eps, at::Tensor q_norm, double q_eps,
                       at::Tensor k_norm, double k_eps, int64_t hq, int64_t hkv, int64_t head_dim, int64_t window,
                       double scaling) {
             const int64_t hidden = input_norm.numel(), W = (hq + 2 * hkv) * head_dim;
             TORCH_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0 && head_dim > 0, "heads: hq a multiple of hkv");
             TORCH_CHECK(qkv.in_features() == hidden && qkv.out_features == W && o.in_features() == hq * head_dim &&
                             o.out_features == hidden && gate_up.in_features() == hidden &&
                             gate_up.out_features % 2 == 0 && down.in_features() == gate_up.out_features / 2 &&
                             down.out_features == hidden && post_norm.numel() == hidden,
                         "a layer plan's linears and norms must chain (hidden ", hidden, ")");
             TORCH_CHECK(q_norm.numel() == 0 || (q_norm.numel() == head_dim && k_norm.numel() == head_dim),
                         "q and k norms: head_dim weights each");
             for (const at::Tensor* t : {&input_norm, &post_norm, &q_norm, &k_norm})
               TORCH_CHECK(t->numel() == 0 || (t->is_contiguous() && t->scalar_type() == at::kFloat),
                           "norm weights: float32 contiguous");
             return std::make_shared<LayerPlan>(LayerPlan{qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm,
                                                          input_eps, post_eps, q_eps, k_eps, hq, hkv, head_dim, window,
                                                          scaling});
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("q_norm"), py::arg("q_eps"),
           py::arg("k_norm"), py::arg("k_eps"), py::arg("hq"), py::arg("hkv"), py::arg("head_dim"), py::arg("window"),
           py::arg("scaling"));
  py::class_<ArgmaxHead, std::shared_ptr<ArgmaxHead>>(m, "ArgmaxHead")
      .def(py::init([](at::Tensor norm, double eps, Linear lm) {
             TORCH_CHECK(norm.numel() == lm.in_features() && norm.is_contiguous() && norm.scalar_type() == at::kFloat,
                         "the final norm: the LM head's input width, float32 contiguous");
             return std::make_shared<ArgmaxHead>(ArgmaxHead{norm, eps, lm});
           }),
           py::arg("norm"), py::arg("eps"), py::arg("lm"));
  py::class_<StepPlan>(m, "StepPlan")
      .def(py::init([](std::vector<std::shared_ptr<LayerPlan>> layers, std::vector<int64_t> kinds, int64_t kinds_n,
                       int64_t embed_kind, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                       int64_t group, double z, int64_t vocab, std::shared_ptr<ArgmaxHead> head) {
             TORCH_CHECK(kinds.size() == layers.size(), "a rotary kind per layer");
             for (const auto& l : layers) TORCH_CHECK(l, "every layer of a plan needs its LayerPlan");
             for (int64_t k : kinds) TORCH_CHECK(0 <= k && k < kinds_n, "rotary kind out of range");
             TORCH_CHECK(embed_kind == -1 || embed_kind == 0 || embed_kind == 2, "embed_kind must be -1, 0 or 2");
             if (embed_kind == 2)
               TORCH_CHECK(codes.dim() == 2 && codes.size(0) >= vocab && codes.scalar_type() == at::kFloat &&
                               codes.is_contiguous() && (!head || codes.size(1) == head->norm.numel()),
                           "a float32 embedding table [vocab, hidden]");
             const int64_t hidden = head ? head->norm.numel() : layers.empty() ? 0 : layers[0]->input_norm.numel();
             if (embed_kind == 0) TORCH_CHECK(hidden > 0, "a plan with an embedding needs its layers or head");
             return StepPlan{std::move(layers), std::move(kinds), embed_kind, codes, scales, offsets, bits, group, z,
                             vocab, std::move(head), hidden};
           }),
           py::arg("layers"), py::arg("kinds"), py::arg("kinds_n"), py::arg("embed_kind"), py::arg("codes"),
           py::arg("scales"), py::arg("offsets"), py::arg("bits"), py::arg("group"), py::arg("z"), py::arg("vocab"),
           py::arg("head"));
  py::class_<HeadPlan>(m, "HeadPlan")
      .def(py::init([](at::Tensor norm_h, double eps_h, at::Tensor norm_f, double eps_f, Linear fuse,
                       std::vector<std::shared_ptr<LayerPlan>> layers, at::Tensor norm_out, double eps_out,
                       Linear lm) {
             TORCH_CHECK(!layers.empty(), "a head plan needs its decoder layers");
             for (const auto& l : layers) TORCH_CHECK(l, "every layer of a head plan needs its LayerPlan");
             const int64_t hidden = norm_h.numel();
             TORCH_CHECK(norm_f.numel() == hidden && norm_out.numel() == hidden && fuse.in_features() == 2 * hidden &&
                             fuse.out_features == hidden && lm.in_features() == hidden,
                         "a head plan's norms and linears must chain (hidden ", hidden, ")");
             for (const at::Tensor* t : {&norm_h, &norm_f, &norm_out})
               TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat, "norm weights: float32 contiguous");
             const size_t L = layers.size();
             StepPlan block{std::move(layers), std::vector<int64_t>(L, 0), -1, at::Tensor(), at::Tensor(),
                            at::Tensor(), 0, 0, 0.0, 0, nullptr, hidden};
             return HeadPlan{norm_h, norm_f, norm_out, eps_h, eps_f, eps_out, fuse, lm, std::move(block)};
           }),
           py::arg("norm_h"), py::arg("eps_h"), py::arg("norm_f"), py::arg("eps_f"), py::arg("fuse"),
           py::arg("layers"), py::arg("norm_out"), py::arg("eps_out"), py::arg("lm"));
  m.def("run_plan", &run_plan,
        "a causal step's rows (or a token's embedding row) through layers [a, b) of a plan, the taps' rows kept, "
        "then each row's argmax if asked",
        py::call_guard<py::gil_scoped_release>());
  m.def("run_segments", &run_segments,
        "several sequences' causal rows through layers [a, b) of a plan at once, each over its own cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("draft_or_step", &draft_or_step,
        "a deep head's first draft of a greedy round, and below the confidence bar the rest of the plain step",
        py::call_guard<py::gil_scoped_release>());
  m.def("head_step", &head_step, "a deep head's draft step: fused features, its layers, the drafted vocabulary's logits",
        py::call_guard<py::gil_scoped_release>());
}
