"""moeplace: measure and fix per-step expert imbalance in MoE serving.

Importing this package pulls in numpy only; torch and SGLang are imported lazily by the
capture, loader and kernel adapters (``moeplace.sglang``, ``moeplace_kernels``).
"""

__version__ = "0.1.0"
