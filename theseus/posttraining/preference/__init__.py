"""Preference tuning (``NAME/train/preference``): the preference section and losses (DPO family,
ORPO, SimPO), the pair rows' completion log-probabilities, the precomputed reference and the
trainer that adds them up on the shared step."""
