"""LLMConfig: precedence flags > environment > config file, prices, and a key that never shows."""

from __future__ import annotations

import json

import pytest

from kforge.errors import LLMError
from kforge.proposers.llm import LLMConfig
from kforge.proposers.llm.config import is_reasoning_model

KEY = "sk-config-SECRET-4242"


def test_flags_beat_environment_beat_file(tmp_path):
    cfg_file = tmp_path / "llm.toml"
    cfg_file.write_text('base_url = "http://file/v1"\nmodel = "file-model"\nmax_cost_usd = 2.5\n'
                        '[prices."file-model"]\nprompt = 1.0\ncompletion = 3.0\n[prices."env-model"]\nprompt = 0.0\ncompletion = 0.0\n')
    env = {"KFORGE_LLM_CONFIG": str(cfg_file), "KFORGE_LLM_MODEL": "env-model", "KFORGE_LLM_API_KEY": KEY}
    from_file_and_env = LLMConfig.resolve(environ=env)
    assert (from_file_and_env.base_url, from_file_and_env.model) == ("http://file/v1", "env-model")
    assert from_file_and_env.max_cost_usd == 2.5 and from_file_and_env.api_key.reveal() == KEY

    flagged = LLMConfig.resolve(environ=env, model="flag-model", base_url=None, max_cost_usd=9.0, price="0,0")
    assert (flagged.model, flagged.base_url, flagged.max_cost_usd) == ("flag-model", "http://file/v1", 9.0)

    priced = LLMConfig.resolve(environ={**env, "KFORGE_LLM_MODEL": "file-model"})
    assert priced.cost(1_000_000, 2_000_000) == pytest.approx(7.0)


def test_openai_variables_are_the_fallback(tmp_path):
    cfg = LLMConfig.resolve(environ={"OPENAI_BASE_URL": "http://o/v1", "OPENAI_API_KEY": KEY,
                                     "KFORGE_LLM_MODEL": "m"})
    assert cfg.base_url == "http://o/v1" and cfg.api_key.reveal() == KEY
    mine = LLMConfig.resolve(environ={"OPENAI_BASE_URL": "http://o/v1", "KFORGE_LLM_BASE_URL": "http://k/v1",
                                      "KFORGE_LLM_MODEL": "m"})
    assert mine.base_url == "http://k/v1"


def test_json_config_file(tmp_path):
    path = tmp_path / "llm.json"
    path.write_text(json.dumps({"model": "local", "base_url": "http://x/v1", "prices": {"local": [0.5, 1.5]},
                                "max_repair_attempts": 1}))
    cfg = LLMConfig.resolve(config_file=path, environ={})
    assert cfg.price() == (0.5, 1.5) and cfg.max_repair_attempts == 1
    assert cfg.price() != LLMConfig(model="gpt-4o").price()


def test_bad_settings_say_what_to_fix(tmp_path):
    with pytest.raises(LLMError, match="KFORGE_LLM_MODEL"):
        LLMConfig.resolve(environ={})
    with pytest.raises(LLMError, match=r"unknown LLM settings \['temprature'\]"):
        LLMConfig.resolve(environ={}, model="m", temprature=0.1)
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(LLMError, match="not valid TOML"):
        LLMConfig.resolve(config_file=bad, environ={})
    with pytest.raises(LLMError, match="cannot read LLM config"):
        LLMConfig.resolve(config_file=tmp_path / "missing.toml", environ={})
    with pytest.raises(LLMError, match="price of 'm'"):
        LLMConfig.resolve(environ={}, model="m", prices={"m": {"prompt": 1}})
    with pytest.raises(LLMError, match="KFORGE_LLM_API_KEY"):
        LLMConfig(model="gpt-4o").key_for_client()


def test_prices_exact_then_provider_prefix_then_dated_snapshot_only():
    def price(model):
        return LLMConfig(model=model).price()

    assert price("gpt-4o-mini-2024-07-18") == price("gpt-4o-mini") != price("gpt-4o") == price("gpt-4o-2024-08-06")
    assert price("openai/gpt-4o") == price("gpt-4o") and price("models/gemini-2.5-pro") == price("gemini-2.5-pro")
    assert price("claude-sonnet-4-20250514") == price("anthropic/claude-sonnet-4") == (3.0, 15.0)
    assert price("claude-3-7-sonnet-latest") == price("claude-3-7-sonnet") and price("mistral-large-2411") == (2.0, 6.0)
    assert price("o3-pro") == (20.0, 80.0) != price("o3")  # a longer name is another model, not a snapshot
    assert price("gpt-4.1-nano") == (0.10, 0.40) != price("gpt-4.1")
    for model in ("deepseek-chat", "gemini-2.5-flash", "claude-opus-4-1", "qwen-plus", "codestral-latest"):
        assert price(model) is not None, model
    assert price("my-local-coder") is None and price("o3-pro-max") is None
    assert LLMConfig(model="my-local-coder").cost(10**6, 10**6) == 0.0


def test_an_unpriced_model_with_a_cost_budget_is_refused_unless_priced():
    with pytest.raises(LLMError, match=r"'my-coder' has no known price.*--llm-price PROMPT,COMPLETION"):
        LLMConfig.resolve(environ={}, model="my-coder", max_cost_usd=1.0)
    priced = LLMConfig.resolve(environ={}, model="my-coder", max_cost_usd=1.0, price=(0.5, 2.0))
    assert priced.price() == (0.5, 2.0) and priced.cost(10**6, 10**6) == pytest.approx(2.5)
    assert LLMConfig.resolve(environ={}, model="gpt-4o", price="1,2").price() == (1.0, 2.0)  # the user's price wins
    with pytest.raises(LLMError, match="price of"):
        LLMConfig.resolve(environ={}, model="m", price=(-1, 2))


def test_provider_settings_and_their_defaults(tmp_path):
    plain, reasoning = LLMConfig(model="gpt-4.1"), LLMConfig(model="deepseek/deepseek-r1")
    for name in ("gpt-4o", "claude-sonnet-4", "qwen2.5-coder-32b", "llama-3.3-70b", "mistral-large-2411"):
        assert not is_reasoning_model(name), name
    assert (plain.max_reply_tokens, plain.temperature) == (8192, 0.7)
    assert (reasoning.max_reply_tokens, reasoning.temperature) == (32768, None)
    for name in ("o1", "o3-mini", "o4-mini", "gpt-5", "gpt-5-mini", "deepseek-reasoner", "qwq-32b", "qwen3-235b-thinking",
                 "openai/gpt-oss-120b", "grok-4"):
        assert LLMConfig(model=name).max_reply_tokens == 32768, name
    path = tmp_path / "llm.toml"
    path.write_text('model = "local"\ntemperature = "none"\ntop_p = 0.9\nreasoning_effort = "low"\n'
                    'max_reply_tokens = 2048\nextra_headers = {X-Team = "k"}\nextra_body = {top_k = 20}\n')
    cfg = LLMConfig.resolve(config_file=path, environ={})
    assert (cfg.temperature, cfg.top_p, cfg.reasoning_effort, cfg.max_reply_tokens) == (None, 0.9, "low", 2048)
    assert cfg.extra_headers == {"X-Team": "k"} and cfg.extra_body == {"top_k": 20}
    assert cfg.public()["extra_headers"] == ["X-Team"]  # names only
    assert LLMConfig.resolve(config_file=path, environ={}, temperature="0.2").temperature == 0.2
    for bad in ({"temperature": "hot"}, {"top_p": 2}, {"max_reply_tokens": 0}, {"extra_body": [1]}):
        with pytest.raises(LLMError, match=next(iter(bad))):
            LLMConfig(model="m", **bad)


def test_key_never_shows():
    cfg = LLMConfig(model="m", base_url="http://x/v1", api_key=KEY)
    assert KEY not in repr(cfg) and KEY not in str(cfg) and KEY not in f"{cfg.api_key}"
    assert "api_key='***'" in repr(cfg)
    public = json.dumps(cfg.public())
    assert KEY not in public and '"api_key_set": true' in public
    assert cfg.key_for_client() == KEY
    assert LLMConfig(model="m", base_url="http://local/v1").key_for_client() == "no-key"
