"""first_difference: the first step whose data two data-schedule records disagree on."""

import copy

import pytest

from levanter.data.schedule_record import first_difference

BASE = {
    "format": 1,
    "seq_len": 128,
    "data_seed": 7,
    "shuffle": True,
    "block_size": None,
    "stop_strategy": "restart",
    "enforce_eos": True,
    "source_order": ["prose", "code", "extra"],
    "sources": {
        "prose": {"rows": 10, "tokens": 1000, "tokenizer": "h", "urls": ["p"], "embedded": {}},
        "code": {"rows": 20, "tokens": 2000, "tokenizer": "h", "urls": ["c"], "embedded": {}},
        "extra": {"rows": 5, "tokens": 500, "tokenizer": "h", "urls": ["e"], "embedded": {}},
    },
    "batch_schedule": [[0, 8], [10, 16]],
    "stages": [[0, {"prose": 0.9, "code": 0.1}], [37, {"prose": 0.2, "code": 0.8}], [60, {"extra": 1.0}]],
}


def edited(fn):
    rec = copy.deepcopy(BASE)
    fn(rec)
    return rec


def test_identical_records_agree():
    assert first_difference(BASE, copy.deepcopy(BASE)) is None


@pytest.mark.parametrize(
    "edit, step, fragment",
    [
        (lambda r: r["stages"].__setitem__(1, [30, r["stages"][1][1]]), 30, "mixture at step 30"),
        (lambda r: r["stages"].__setitem__(1, [45, r["stages"][1][1]]), 37, "mixture at step 37"),
        (lambda r: r["stages"][1][1].update(prose=0.3), 37, "mixture at step 37"),
        (lambda r: r["stages"].append([80, {"prose": 1.0}]), 80, "mixture at step 80"),
        (lambda r: r["batch_schedule"].__setitem__(1, [12, 16]), 10, "batch size at step 10"),
        (lambda r: r["batch_schedule"].append([50, 32]), 50, "batch size at step 50"),
        (lambda r: r["sources"]["extra"].update(tokens=501), 60, "'extra' changed"),
        (lambda r: r["sources"]["prose"].update(rows=11), 0, "'prose' changed"),
        (lambda r: r.update(seq_len=256), 0, "seq_len"),
        (lambda r: r.update(data_seed=8), 0, "data_seed"),
        # named by its config key, with the value that resumes as trained
        (lambda r: r.update(shuffle=False), 0, "data.shuffle changed from true to false (the run was trained "
                                               "with data.shuffle: true)"),
        (lambda r: r.update(source_order=["code", "prose", "extra"]), 0, "order of sources"),
    ],
)
def test_first_differing_step(edit, step, fragment):
    got = first_difference(BASE, edited(edit))
    assert got is not None and got[0] == step, got
    assert fragment in got[1]


def test_scaling_weights_is_not_a_change():
    # Weights are normalised: {extra: 1} and {extra: 3} give the same data.
    rec = edited(lambda r: r["stages"].__setitem__(2, [60, {"extra": 3.0}]))
    assert first_difference(BASE, rec) is None


def test_adding_a_source_only_matters_where_it_is_drawn():
    rec = edited(lambda r: (r["sources"].__setitem__("new", {"rows": 1, "tokens": 1, "tokenizer": "h", "urls": ["n"],
                                                             "embedded": {}}),
                            r["source_order"].append("new"), r["stages"].append([90, {"new": 1.0}])))
    assert first_difference(BASE, rec)[0] == 90
