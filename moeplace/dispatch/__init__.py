"""Per-step dispatch among an expert's replicas: SGLang's rules and moeplace's (balanced, by cost), LPLB's
emulation, the exact per-step optimum, the rank loads each rule gives, and their evaluation on batches."""
