"""Drafters: where speculative tokens come from (`Drafter`, drafters/base.py). The engine builds them from the
--drafter setting (service/engine/llm_engine.py, `build_drafters`)."""
