"""What a step costs: the per-rank cost model (``model``), its derivation from the experts' shape
(``derive``) and the H200 measurements it is calibrated on (``measured/``)."""
