"""The one bearer-token comparison every DCS server uses (`dcs_tasks.auth`), and SGLang's public routes."""

from __future__ import annotations

from dcs_tasks.auth import bearer_token_matches, sglang_public


def test_only_the_exact_token_after_a_bearer_scheme_matches() -> None:
    token = "s3cret-token"
    assert bearer_token_matches(f"Bearer {token}", token)
    assert bearer_token_matches(f"bearer {token}".encode(), token)  # the scheme is case-insensitive
    for wrong in (None, "", token, f"Basic {token}", f"Bearer {token}x", f"Bearer {token[:-1]}", "Bearer "):
        assert not bearer_token_matches(wrong, token)
    assert not bearer_token_matches(f"Bearer  {token}", token)  # no silent trimming


def test_sglang_public_routes_are_probes_and_metrics_only() -> None:
    for method, path in (("GET", "/health"), ("GET", "/health_generate"), ("GET", "/metrics"), ("OPTIONS", "/x")):
        assert sglang_public(method, path)
    for path in ("/init_weights_update_group", "/weights_digest", "/model_info", "/server_info", "/openapi.json"):
        assert not sglang_public("POST", path) and not sglang_public("GET", path)
