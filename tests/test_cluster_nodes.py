"""Which nodes may evaluate a run's cards, and the cluster options refused before any work.
Pure logic: these run without Ray."""

from __future__ import annotations

import sys

import pytest
import torch
from fakes import toy_card

from kforge import __version__, runner
from kforge.cluster import ClusterError, open_pool, ray_address
from kforge.cluster.nodes import Reference


def facts(arch="sm_90", name="NVIDIA H200", driver=13000, torch_version=torch.__version__, kforge=__version__):
    return {"gpus": [{"name": name, "arch": arch}], "driver": driver, "torch": torch_version, "kforge": kforge}


def test_the_first_matching_node_sets_gpu_and_driver_and_every_other_must_agree():
    ref = Reference.for_cards([toy_card()])
    assert ref.arch == "sm_90" and ref.gpu is None
    assert ref.refusal(facts()) is None
    assert (ref.gpu, ref.driver) == ("NVIDIA H200", 13000)
    assert ref.refusal(facts()) is None
    cases = {"GPU arch sm_80 (the cards are for sm_90)": facts(arch="sm_80"),
             "GPU NVIDIA H100 (the run times on NVIDIA H200)": facts(name="NVIDIA H100"),
             "CUDA driver 12080 (the run's is 13000)": facts(driver=12080),
             "torch 1.0.0 (the run's is": facts(torch_version="1.0.0"),
             "kforge 0.0.1 (the run's is": facts(kforge="0.0.1")}
    for what, f in cases.items():
        why = ref.refusal(f)
        assert why.startswith("it has ") and what in why and why.endswith("or take it out of the cluster"), why


def test_without_cards_the_arch_most_gpus_have_is_the_reference_whatever_the_node_order():
    """`kforge doctor` (no cards): an sm_80 node listed first must not make the sm_90 ones the odd ones out."""
    nodes = [facts(arch="sm_80"), facts(), facts()]
    ref = Reference.for_cards([])
    assert ref.arch is None
    ref.settle_arch(nodes)
    assert [ref.refusal(f) is None for f in nodes] == [False, True, True]


def test_a_torch_build_tag_is_the_same_torch_and_a_node_without_gpu_is_refused():
    ref = Reference.for_cards([toy_card()])
    release = torch.__version__.split("+")[0]
    assert ref.refusal(facts(torch_version=release + "+cu130")) is None
    assert "no usable CUDA GPU" in ref.refusal({**facts(), "gpus": []})


def test_cluster_values_and_devices_with_a_cluster_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address("ray") == "auto" and ray_address("ray://head:10001") == "ray://head:10001"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address("ray") == "10.0.0.1:6379"
    with pytest.raises(ClusterError, match="unknown cluster 'slurm'"):
        open_pool("slurm", tmp_path, [], runner.default_evaluator)
    with pytest.raises(ClusterError, match="leave out --devices"):
        open_pool("ray", tmp_path, [], runner.default_evaluator, devices=[0])


def test_without_ray_a_cluster_run_says_what_to_install_in_one_line(tmp_path, monkeypatch, capsys):
    from kforge import cli
    from kforge.card_files import save_card

    save_card(toy_card(), tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    assert cli.main(["search", str(tmp_path), "--cluster", "ray", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: --cluster ray needs Ray: pip install 'kforge[ray]'"


def test_run_refuses_a_cluster_option_that_cannot_work_before_capturing(tmp_path):
    with pytest.raises(ClusterError, match="unknown cluster 'slurm'"):
        runner.run(torch.nn.ReLU(), torch.randn(4), run_dir=tmp_path / "run", cluster="slurm", progress=False)
    assert not (tmp_path / "run").exists()
