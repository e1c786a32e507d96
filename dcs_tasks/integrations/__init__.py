"""DCS under training frameworks: one module per framework (`lightning`, `hf`, ...), each importing its framework
itself. Nothing else in `dcs_tasks` imports this package, so DCS does not depend on any of them; a user imports the
module of the framework they train with (`from dcs_tasks.integrations.lightning import DCSCheckpointIO`)."""
