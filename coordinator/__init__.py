"""The DCS coordinator: a stateless FastAPI control plane over Redis (`create_app(config)`, `dcs coordinator`)."""
