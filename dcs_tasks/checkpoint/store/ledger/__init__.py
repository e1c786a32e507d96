"""Committed steps and the rules over them (store stage): the Redis ledger that fences a step's persist and commit
tasks (`stepledger`, its Lua scripts in `ledger_scripts`), the `latest` pointer moved forward (`latest`), the
committed steps and ranks of a run as its store holds them (`steps`), incremental references to earlier steps
(`incremental`), retention (`retention`) and the Redis locks of runs kept in an object store (`objlocks`). This file
stays a docstring (a re-export would be an import edge)."""
