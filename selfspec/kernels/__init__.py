"""Linear kernels for decoding, chosen per device and dtype (see ``selfspec.kernels.linear``)."""

from selfspec.kernels.linear import PackedLinear, kernel_name, pack_linear

__all__ = ["PackedLinear", "kernel_name", "pack_linear"]
