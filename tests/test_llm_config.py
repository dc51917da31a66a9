"""LLMConfig: precedence flags > environment > config file, prices, and a key that never shows."""

from __future__ import annotations

import json

import pytest

from kforge.errors import LLMError
from kforge.proposers.llm import LLMConfig

KEY = "sk-config-SECRET-4242"


def test_flags_beat_environment_beat_file(tmp_path):
    cfg_file = tmp_path / "llm.toml"
    cfg_file.write_text('base_url = "http://file/v1"\nmodel = "file-model"\nmax_cost_usd = 2.5\n'
                        '[prices."file-model"]\nprompt = 1.0\ncompletion = 3.0\n')
    env = {"KFORGE_LLM_CONFIG": str(cfg_file), "KFORGE_LLM_MODEL": "env-model", "KFORGE_LLM_API_KEY": KEY}
    from_file_and_env = LLMConfig.resolve(environ=env)
    assert (from_file_and_env.base_url, from_file_and_env.model) == ("http://file/v1", "env-model")
    assert from_file_and_env.max_cost_usd == 2.5 and from_file_and_env.api_key.reveal() == KEY

    flagged = LLMConfig.resolve(environ=env, model="flag-model", base_url=None, max_cost_usd=9.0)
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


def test_prices_match_dated_snapshots_and_unknown_models_are_free():
    assert LLMConfig(model="gpt-4o-mini-2024-07-18").price() == LLMConfig(model="gpt-4o-mini").price()
    assert LLMConfig(model="gpt-4o-2024-08-06").price() == LLMConfig(model="gpt-4o").price()
    assert LLMConfig(model="my-local-coder").cost(10**6, 10**6) == 0.0


def test_key_never_shows():
    cfg = LLMConfig(model="m", base_url="http://x/v1", api_key=KEY)
    assert KEY not in repr(cfg) and KEY not in str(cfg) and KEY not in f"{cfg.api_key}"
    assert "api_key='***'" in repr(cfg)
    public = json.dumps(cfg.public())
    assert KEY not in public and '"api_key_set": true' in public
    assert cfg.key_for_client() == KEY
    assert LLMConfig(model="m", base_url="http://local/v1").key_for_client() == "no-key"
