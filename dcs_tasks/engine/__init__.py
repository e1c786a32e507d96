"""Real rollout engines (SGLang servers) in the DCS topology: `dcs engine attach` registers one and keeps it alive."""
