"""Evaluation and advice: metrics over a trace, the report and its plots, the fit-and-score job behind
``optimize``, and the layouts ``advise`` compares."""
