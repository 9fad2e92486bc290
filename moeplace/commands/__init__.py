"""Click commands, one module each; imported lazily by moeplace.cli."""
