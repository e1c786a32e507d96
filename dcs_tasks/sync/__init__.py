"""Weight synchronisation: group planning, wire models, quantization, the bucketed sender and updaters."""
