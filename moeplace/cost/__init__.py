"""What a step costs: the per-rank cost model (``model``), its derivation from the experts' shape
(``derive``), the GPU measurements it is calibrated on (``measured/``: the H200's and the H100's), and the
sweeps `moeplace calibrate` measures a GPU with (``sweeps``, ``cost_set``, ``gpus``)."""
