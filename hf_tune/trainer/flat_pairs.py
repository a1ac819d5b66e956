"""The mixin that runs a DPO trainer's pairs as flattened rows (``hf_tune.model.flat_pairs``) where the run decided
padding-free batches (``RunDecisions.padding_free``)."""

from __future__ import annotations

from hf_tune.errors import RecipeError
from hf_tune.model.chunked_head import chunked_loss_head
from hf_tune.model.flat_pairs import check_flat_pairs, install_flat_pairs, uninstall_flat_pairs


class FlatPreferenceRows:
    """Mixin over TRL's ``DPOTrainer`` (before it in the bases). ``flat_pairs``: the run's decision;
    ``example_boundaries``: the attention reads the rows' boundaries (varlen); ``fall_back``: called with
    ``(name, value, why)`` where the proof on the model fails (``Run.fall_back``), and the pairs then run padded.
    Installed once TRL has patched its fused head: at the end of ``__init__``, or at the reference pass TRL runs
    inside it (``precompute_ref_log_probs``), whichever comes first."""

    def __init__(self, *args, flat_pairs: bool = False, example_boundaries: bool = True, fall_back=None, **kwargs):
        self.flat_pairs, self._flat_pending = flat_pairs, flat_pairs
        self._example_boundaries, self._flat_fall_back = example_boundaries, fall_back
        super().__init__(*args, **kwargs)
        self._install_flat_pairs()

    def compute_ref_log_probs(self, model, inputs):
        self._install_flat_pairs()
        return super().compute_ref_log_probs(model, inputs)

    def _install_flat_pairs(self) -> None:
        if not self._flat_pending:
            return
        self._flat_pending = False
        models = [self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model]
        if getattr(self, "ref_model", None) is not None:
            models.append(self.ref_model)
        try:
            for model in models:
                head = chunked_loss_head(model)
                install_flat_pairs(model, head, self._example_boundaries)
                check_flat_pairs(model, head)
        except RecipeError as error:
            for model in models:
                uninstall_flat_pairs(model)
            self.flat_pairs = False
            if self._flat_fall_back is None:
                raise
            self._flat_fall_back("padding_free", False, f"{error.problem}; the pairs run padded")
