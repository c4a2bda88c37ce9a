"""The production-shape check (`benchmarks/gpu_check.py`) on its CPU path, and its arithmetic."""

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu_check, production


def test_phases_of_a_cycle_amortise_to_its_mean():
  # Steps that only precondition take 1 s, factor steps 3 s, decomposition steps 10 s: the mean
  # over one whole (10, 100) cycle is what the amortised formula gives.
  fus, ivs = 10, 100
  seconds = [10.0 if k % ivs == 0 else 3.0 if k % fus == 0 else 1.0 for k in range(2 * ivs + 1)]
  phases = production.phase_seconds(seconds, (fus, ivs))
  assert phases == {"plain": 1.0, "factors": 3.0, "decomposition": 10.0}
  cycle = float(np.mean(seconds[1 : ivs + 1]))
  assert production.amortised(phases, (fus, ivs)) == pytest.approx(cycle, rel=1e-12)
  assert production.amortised(phases, (50, 500)) == pytest.approx(1.0 + 2.0 / 50 + 7.0 / 500)


def test_production_shapes_are_the_published_architectures():
  import jax

  def count(model, x):
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

  shapes = production.SHAPES
  resnet = count(shapes["resnet50"].model, jax.ShapeDtypeStruct((1, 224, 224, 3), "float32"))
  bert = count(shapes["bert_base"].model, jax.ShapeDtypeStruct((1, 128), "int32"))
  assert resnet == 25_557_032  # ResNet-50 as published (torchvision's count)
  # BERT-Base: 110 M with the pooler; without it (no next-sentence head here) 109.5 M, and the
  # MLM head's transform and decoder bias.
  assert bert == 109_514_298


def test_cpu_path_runs_every_section(tmp_path):
  out = tmp_path / "check.json"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    results = gpu_check.main(["--tiny", "--models", "bert_base", "--out", str(out)])
  assert results["failed"] == {}
  assert json.loads(out.read_text())["models"].keys() == {"tiny_bert"}
  r = results["models"]["tiny_bert"]
  assert r["layers"] == 16  # 3 embeddings, 2 blocks of 4 attention projections and 2 dense, 1 head
  assert r["losses"][10] < r["losses"][0]
  assert [c["cadence"] for c in r["cadences"]] == [[10, 100], [50, 500]]
  assert all(c["flop_ratio"] > 1 for c in r["cadences"])
  assert r["cadences"][0]["measured_cycle"] > 0
  sizes = sorted({d["size"] for d in r["decompositions"]})
  assert sizes == [16, 17, 32, 33]  # width 16 and MLP 32, each + 1 for the bias
  assert [s["fraction"] for s in r["spread_8"]] == ["1/8", "2/8", "4/8", "8/8"]
  assert all(0 < s["decomposition_share"] <= 1 for s in r["spread_8"])
  assert len(r["projections"]) == 4  # the three presets and the rates measured here
  page = gpu_check.render(results)
  assert "tiny BERT" in page and "PROJECTED" in page


def test_factors_of_one_size_are_timed_as_one_batched_call_with_either_method():
  s = production.setup("tiny_bert", 4)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _, _, kfac = production.kfac_step(s, (10, 100), compute_method="inverse")
  rows = production.batch_seconds(kfac, repeats=1)
  # Width 16, MLP 32, two blocks. 16 wide: the output side of the three embeddings, of the
  # eight attention projections, of both blocks' second MLP layer and of the head; 17: the input
  # side of the projections, of the first MLP layers and of the head; 32 and 33: the MLP's.
  assert [(r["size"], r["matrices"], r["method"]) for r in rows] == [
    (16, 14, "inverse"),
    (17, 11, "inverse"),
    (32, 2, "inverse"),
    (33, 2, "inverse"),
  ]
  assert all(r["seconds"] > 0 for r in rows)


def test_a_projected_advantage_counts_only_beyond_the_measured_error():
  from benchmarks import projected_time_to_target as ptt

  h100, a100 = "DGX H100 (8x H100-SXM5-80GB)", "DGX A100 (8x A100-SXM4-80GB)"
  check = {
    "environment": {"device": "gpu: NVIDIA H100 80GB HBM3"},
    "models": {
      "a": {"projections": [{"cluster": h100, "sgd_error": -0.49, "kfac_error": -0.79}]},
      "b": {"projections": [{"cluster": h100, "sgd_error": 0.1, "kfac_error": 0.3}]},
      # a preset measured on another GPU's kind does not count for it
      "c": {"projections": [{"cluster": a100, "sgd_error": 0.01, "kfac_error": 0.02}]},
    },
  }
  errors = ptt.measured_errors(check, [h100, a100])
  assert errors == {h100: pytest.approx(0.79), a100: None}
  assert ptt.established(0.7, errors[h100]) == "not established (30 % < 79 %)"
  assert ptt.established(0.2, errors[h100]) == "yes"
  assert ptt.established(0.2, errors[a100]) == "not established (preset never measured)"
  assert ptt.established(1.1, errors[h100]) == "no advantage"
  assert ptt.established(None, errors[h100]) == "n/a"


def test_a_study_in_progress_is_not_projected(tmp_path, monkeypatch, capsys):
  from benchmarks import projected_time_to_target as ptt

  line = {"task": "charlm", "batch": 128, "optimizer": "adamw"}
  scaling = tmp_path / "scaling.json"
  scaling.write_text(json.dumps({"tasks": {"charlm": [line]}, "unrun": {"charlm": [512, 1024]}}))
  monkeypatch.setattr(ptt, "project_task", lambda *a: pytest.fail("projected a partial study"))
  monkeypatch.setattr(sys, "argv", ["ptt", "--scaling", str(scaling), "--publish"])
  ptt.main()
  assert (
    "charlm: its study is in progress (batches 512, 1024 not run yet)" in capsys.readouterr().out
  )
  assert ptt.scale.unrun_of(json.loads(scaling.read_text()), "mnist1d") == []


def test_a_preset_is_checked_on_its_own_gpu_and_the_h100s_on_an_h200():
  h100, a100 = "DGX H100 (8x H100-SXM5-80GB)", "DGX A100 (8x A100-SXM4-80GB)"
  assert gpu_check.comparable(h100, "gpu: NVIDIA H100 80GB HBM3")
  assert gpu_check.comparable(h100, "gpu: NVIDIA H200")
  assert not gpu_check.comparable(h100, "gpu: NVIDIA A100-SXM4-80GB")
  assert gpu_check.comparable(a100, "gpu: NVIDIA A100-SXM4-80GB")
  assert not gpu_check.comparable(a100, "gpu: NVIDIA H200")
  h200 = "DGX H200 (8x H200-SXM-141GB)"
  assert gpu_check.comparable(h200, "gpu: NVIDIA H200")
  assert not gpu_check.comparable(h200, "gpu: NVIDIA H100 80GB HBM3")
  assert gpu_check.comparable("measured here (cpu)", "cpu: cpu")


def test_the_check_turns_triton_gemm_fusions_off_unless_told(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  gpu_check.default_xla_flags()
  assert (
    gpu_check.os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false"
  )
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
  gpu_check.default_xla_flags()
  assert gpu_check.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
  monkeypatch.delenv("XLA_FLAGS")
  gpu_check.default_xla_flags()
  assert gpu_check.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"


def test_programs_counted_from_shapes_on_the_host_match_the_compiled_ones(monkeypatch):
  """What a GPU run counts (the programs compiled for the CPU from shapes, `projection.on_host`)
  is what the CPU path counts from the programs it compiled and ran."""
  s = production.setup("tiny_resnet", 2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sgd = production.sgd_step(s)
    *kfac_step, kfac = production.kfac_step(s, gpu_check.CADENCES[0])
  compiled = [gpu_check.compile_row(n, *p, s.batch)[0] for n, p in zip("SK", (sgd, kfac_step))]
  direct, host = {}, {}
  gpu_check._costs(direct, s, kfac, sgd, kfac_step, compiled)
  monkeypatch.setattr(gpu_check.jax, "default_backend", lambda: "gpu")  # the path a GPU takes
  gpu_check._costs(host, s, kfac, sgd, kfac_step, compiled)
  assert host["flops_counted_on"] == "cpu"
  for program in ("sgd", "kfac_step"):  # the same programs: the same flops (not the same bytes:
    for kind in ("xla", "lapack"):  # the CPU path's were compiled with their carry donated)
      assert host["flops"][program][kind] == direct["flops"][program][kind], program
  # The phases compiled alone follow the device's strategy (no CPU loop on a GPU): the same work
  # in other loops, counted within 1 %. One exception: XLA's cost analysis counts an elementwise
  # producer fused into a consumer of a slice of it at the producer's whole shape. On a GPU one
  # batched ``eigh`` per factor size feeds one slice per layer, so the NaN fill of its results is
  # counted once per layer that slices it (each reading one matrix of it); in the CPU's loop the
  # fill runs inside the loop body. Here those elementwise flops are 0.06 % of the phase's.
  for phase in ("factors", "decompositions", "preconditioning"):
    got, want = (c["flops"][phase]["xla"] + c["flops"][phase]["lapack"] for c in (host, direct))
    assert got == pytest.approx(want, rel=1e-2), phase
    for kind in ("xla", "lapack"):
      if (phase, kind) != ("decompositions", "xla"):
        got, want = host["flops"][phase][kind], direct["flops"][phase][kind]
        assert got == pytest.approx(want, rel=1e-2), (phase, kind)
  # Every convolution and product is in the count: the K-FAC step holds SGD's and more.
  assert direct["flops"]["kfac_step"]["xla"] > direct["flops"]["sgd"]["xla"] > 1e6
  assert direct["flops"]["factors"]["xla"] > 0 and direct["flops"]["decompositions"]["lapack"] > 0
