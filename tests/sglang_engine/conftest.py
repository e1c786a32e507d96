"""The `sglang_engine` factory fixture for the tests here (other test folders can re-export it the same way)."""

from tests.sglang_engine.harness import sglang_engine as sglang_engine
