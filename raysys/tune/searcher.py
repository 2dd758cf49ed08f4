"""The sweep's searcher: Ray Tune's Optuna searcher, telling Optuna a trial without objectives as failed."""

from __future__ import annotations

import math

from ray.tune.search.optuna import OptunaSearch as _RayOptunaSearch


class OptunaSearch(_RayOptunaSearch):
    """A trial whose last report has no finite objectives (it failed without a restart, or stopped
    before its first measurement) is told to the study as failed. Ray's class tells Optuna the NaN,
    which Optuna refuses with a warning on the console, and the trial then stays 'running' in the
    study."""

    def on_trial_complete(self, trial_id, result=None, error=False):
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        values = [(result or {}).get(m) for m in metrics]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            result, error = None, True
        super().on_trial_complete(trial_id, result, error)
