"""GPU kernels for moeplace (installed as ``moeplace_kernels``)."""
