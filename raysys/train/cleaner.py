"""Ray Train's trainers with a placement-group cleaner that takes "not found" for "not known", not "dead".

Ray Train V2 starts, per fit, a detached ``PlacementGroupCleaner`` that removes the run's placement group
once the State API stops showing the run's controller alive. It reads any answer but a live actor as death,
and the State API answers "not found" for a live controller whenever it asks another cluster: a Ray started
without a dashboard (a sweep's, `raysys.tune`) sends State API calls to 127.0.0.1:8265, where the dashboard
of any other Ray on the machine answers (a `raysys train` in the next terminal, a `ray start`). The cleaner
then removed the group under a live run: its workers exited and the run spent a restart
(``launch.max_failures``) on nothing, sometimes all of them.

Here the controller is dead only when the State API says "DEAD" -- what it says of an actor that died in
this cluster. An answer that cannot tell leaves the group alone; Ray still removes it when the job that made
it ends.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer as _TorchTrainer
from ray.train.v2._internal.callbacks import placement_group_callback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2._internal.execution.controller import placement_group_cleaner
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner
from ray.train.v2.jax import JaxTrainer as _JaxTrainer
from ray.util.state import get_actor


def said_alive(actor_id: str, timeout: float) -> bool:
    """False only when the State API says the actor is DEAD; "not found" (None) is not a death, nor is no
    answer. Asked through this cluster's GCS: found from the machine ("auto"), several Ray instances on one
    machine were an error that ended Ray's monitor thread."""
    import ray

    try:
        state = get_actor(actor_id, address=ray.get_runtime_context().gcs_address, timeout=timeout)
    except Exception:  # the State API not answering: nothing said of the actor
        return True
    return state is None or state.state != "DEAD"


class _Cleaner(PlacementGroupCleaner):
    def _monitor_loop(self):
        # the cleaner is a detached actor alone in its process: this reaches only its own loop
        placement_group_cleaner.is_actor_alive = said_alive
        super()._monitor_loop()


class CleanerCallback(PlacementGroupCleanerCallback):
    """Ray's callback, launching ``_Cleaner``."""

    def after_controller_start(self, train_run_context):
        # the controller is an actor alone in its process: this reaches only its own launch
        placement_group_callback.PlacementGroupCleaner = _Cleaner
        super().after_controller_start(train_run_context)


class _Careful:
    def _create_default_callbacks(self):
        return [CleanerCallback() if type(c) is PlacementGroupCleanerCallback else c
                for c in super()._create_default_callbacks()]


class TorchTrainer(_Careful, _TorchTrainer):
    """``ray.train.torch.TorchTrainer`` whose cleaner removes a group only under a controller Ray says is dead."""


class JaxTrainer(_Careful, _JaxTrainer):
    """``ray.train.v2.jax.JaxTrainer`` whose cleaner removes a group only under a controller Ray says is dead."""
