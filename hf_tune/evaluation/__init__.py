"""Downstream evaluation: lm-evaluation-harness tasks on the model in memory (``harness``), the tasks hf_tune ships
(``tasks/``, offline), and generation samples at each evaluation."""
