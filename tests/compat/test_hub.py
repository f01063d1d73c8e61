"""The one reading of the hub's environment (``levanter.utils.hub``): offline flags as huggingface_hub reads
them, and the endpoint."""

from __future__ import annotations

import pytest

from levanter.utils import hub

_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "True", "yes", "on", "ON"])
def test_true_values_put_the_hub_offline(monkeypatch, value):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub.hub_offline()
    assert hub.offline_variable() == "HF_HUB_OFFLINE"


@pytest.mark.parametrize("value", ["", "0", "false", "FALSE", "no", "off", "2"])
def test_other_values_leave_it_online(monkeypatch, value):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert not hub.hub_offline()
    assert hub.offline_variable() is None


def test_transformers_offline_counts_only_when_hf_hub_offline_is_unset(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub.offline_variable() == "TRANSFORMERS_OFFLINE"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set: it decides, as in huggingface_hub
    assert hub.offline_variable() is None


def test_datasets_offline_counts_for_datasets_only(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert not hub.hub_offline()
    assert hub.offline_variable(datasets=True) == "HF_DATASETS_OFFLINE"


def test_endpoint_and_host(monkeypatch):
    assert hub.hub_endpoint() == "https://huggingface.co"
    assert hub.hub_host() == "huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example:8080/hf")
    assert hub.hub_host() == "mirror.example"


def test_an_endpoint_whose_host_does_not_resolve_is_unreachable(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://no-such-host.invalid")
    why = hub.hub_unreachable()
    assert why is not None and why.startswith("the Hugging Face hub (no-such-host.invalid) is unreachable (")
