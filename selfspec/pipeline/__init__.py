"""Drafting and verifying at the same time (PPSD): the shallow stage (layers [0, k) + the exit head)
and the deep stage (layers [k, L) + the LM head) as two workers.

costs.py  the cost model: the pipeline's expected speed on two devices from measured stage costs
ppsd.py   the two-process pipeline over torch.distributed (gloo on CPU)
See docs/PIPELINE.md.
"""
