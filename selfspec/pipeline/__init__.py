"""Drafting and verifying at the same time (PPSD, Mirror-SD): the shallow stage (layers [0, k) + the exit
head) and the deep stage (layers [k, L) + the LM head) as two workers.

ppsd.py       the shallow stage and ``Pipeline`` (PPSD's draft-ahead, Mirror-SD's branches)
deep.py       the deep stage: verifies blocks, sends Mirror-SD's early signal
transport.py  the messages between them: two processes (torch.distributed) or two threads (one device)
costs.py      the cost model: the pipeline's expected speed on two devices from measured stage costs
See docs/PIPELINE.md.
"""

from selfspec.pipeline.ppsd import ModelSource, Pipeline, PipelineStats
from selfspec.pipeline.transport import PipelineError

__all__ = ["ModelSource", "Pipeline", "PipelineError", "PipelineStats"]
