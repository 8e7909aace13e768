"""A real Hugging Face Trainer (tiny Llama, in-memory dataset, CPU) traced by the callback:
an fp32 reference against a bf16 target that replays it, under gradient accumulation."""
from __future__ import annotations

import pytest
import torch
from conftest import record_builtin
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.integrations.transformers import DriftcheckCallback
from driftcheck.store import TraceReader
from driftcheck.targets import faults

FAULTY = "model.layers.1.mlp"


def _train(tmp, out, *, replay=None, bf16=False, accumulation=2, seed=0, fault=None, steps=2,
           callback=True, max_steps=3, compile_backend=None, **kw):
    """A Trainer run; the target is built from another seed and another data order, so only the
    replay can make it start where the reference started."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(cfg)
    if fault:
        faults.scale_output(FAULTY, fault)(model)
    g = torch.Generator().manual_seed(seed + 1)
    data = [{"input_ids": (ids := torch.randint(0, 64, (12,), generator=g)), "labels": ids}
            for _ in range(24)]
    args = TrainingArguments(output_dir=str(tmp / f"trainer-{out}"), max_steps=max_steps,
                             per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                             learning_rate=1e-3, report_to=[], use_cpu=True, bf16=bf16,
                             save_strategy="no", disable_tqdm=True, logging_strategy="no",
                             data_seed=seed, seed=seed, torch_compile=compile_backend is not None,
                             **({"torch_compile_backend": compile_backend} if compile_backend else {}))
    cb = DriftcheckCallback(tmp / out, steps=steps, replay=replay, force=True, **kw) if callback else None
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb] if cb else None).train()
    return model, cb


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    _train(tmp, "ref")
    return tmp, tmp / "ref"


def test_reference_is_a_complete_trace_of_the_chosen_steps(ref):
    _, path = ref
    r = TraceReader(path)
    assert r.run["steps"] == 2 and r.run["driver"] == "transformers.Trainer"
    keys = {(e["step"], e["phase"]) for e in r.entries}
    assert {(0, "forward"), (0, "backward"), (0, "grads"), (0, "optimizer"), (1, "loss")} <= keys
    # two micro-batches per step: every module is called twice
    calls = {e["call"] for e in r.entries if e["module"] == "model.layers.0.mlp" and e["phase"] == "forward"}
    assert calls == {0, 1}


def test_replay_in_fp32_is_bitwise_from_other_weights_and_data(ref):
    tmp, path = ref
    _train(tmp, "same", replay=path, seed=7)
    rep = compare(path, tmp / "same")
    assert rep and max(e.ratio for e in rep.entries if e.ratio is not None) == 0


def test_bf16_target_passes_and_a_fault_is_caught_at_its_module(ref):
    tmp, path = ref
    _train(tmp, "bf16", replay=path, bf16=True, seed=3)
    rep = compare(path, tmp / "bf16")
    assert rep, rep.decided_by
    assert TraceReader(tmp / "bf16").run["autocast"] == "bf16"
    _train(tmp, "fault", replay=path, bf16=True, seed=3, fault=1.2)
    bad = compare(path, tmp / "fault")
    assert not bad
    assert bad.first_divergence["module"] == FAULTY and bad.first_divergence["phase"] == "forward"


def test_tracing_does_not_change_the_training(tmp_path):
    traced, _ = _train(tmp_path, "t", max_steps=3)
    plain, _ = _train(tmp_path, "u", max_steps=3, callback=False)
    for (n, a), (_, b) in zip(traced.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), n


def test_training_goes_on_after_the_traced_steps_or_stops(tmp_path):
    _, cb = _train(tmp_path, "go", steps=1, max_steps=3)
    assert cb.session.done and TraceReader(tmp_path / "go").run["steps"] == 1
    _, cb = _train(tmp_path, "stop", steps=1, max_steps=3, stop=True)
    assert cb.session.done


def test_a_target_with_other_accumulation_is_refused_in_one_line(ref):
    tmp, path = ref
    with pytest.raises(DriftcheckError, match="gradient accumulation"):
        _train(tmp, "acc", replay=path, accumulation=1)


def test_a_driftcheck_record_trace_is_not_a_callback_replay(tmp_path):
    plain = record_builtin("mlp", tmp_path / "mlp")
    with pytest.raises(DriftcheckError, match="recorded by `driftcheck record`"):
        _train(tmp_path, "x", replay=plain)


def test_a_callback_trace_is_not_a_driftcheck_record_replay(ref, tmp_path):
    from conftest import dc

    _, path = ref
    proc = dc("record", "mlp", "--out", str(tmp_path / "t"), "--replay", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "training-loop callback" in proc.stderr


@pytest.mark.parametrize("kwargs, words", [
    ({"steps": 0}, "steps must be at least 1"), ({"steps": [-1]}, "steps must be at least 1"),
    ({"mode": "bogus"}, "mode must be one of"), ({"replay": "/nonexistent/ref"}, "not a trace directory"),
])
def test_bad_arguments_are_refused_before_training(tmp_path, kwargs, words):
    with pytest.raises(DriftcheckError, match=words):
        DriftcheckCallback(tmp_path / "x", **kwargs)


def test_clipped_gradients_pass_their_clip_factors_error_to_the_optimizer_state(tmp_path):
    """The Trainer clips by the global gradient norm (max_grad_norm=1): every Adam moment is of
    g * max_norm / |G|, and |G|'s bf16 error (over all parameters) reaches the moments of
    parameters whose own gradient is almost exact. hf_esm's lm_head bias failed at 5.56 on a
    clean bf16 target, hf_bit's classifier bias at 18.3, before the floor took the clip factor."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import trainer_zoo
    import zoo

    for name in ("hf_esm", "hf_bit"):
        build = zoo.CATALOGUE[name][1]
        trainer_zoo._trainer(build(), tmp_path / f"{name}-ref", tmp_path)
        trainer_zoo._trainer(build(), tmp_path / f"{name}-bf16", tmp_path, replay=tmp_path / f"{name}-ref",
                             bf16=True)
        assert TraceReader(tmp_path / f"{name}-ref").run["grad_clip"] == {"norm": 1.0}
        rep = compare(tmp_path / f"{name}-ref", tmp_path / f"{name}-bf16")
        assert rep, f"{name}: {rep.decided_by}"


def test_a_trainer_that_compiles_the_model_is_traced_as_compiled(ref, tmp_path):
    """TrainingArguments(torch_compile=True): accelerate compiles the model; the callback's own
    hooks around it run eagerly (no break or recompilation of the capture's), the run records
    Dynamo's account, and the compiled target replaying the eager reference passes."""
    _, path = ref
    _train(tmp_path, "tgt", replay=path, seed=1, compile_backend="aot_eager")
    torch._dynamo.reset()
    r = TraceReader(tmp_path / "tgt")
    assert r.run["compile"]["graph_breaks"] == 0 and r.run["compile"]["graphs"] >= 1
    # No break or recompilation of the capture's (the model's own recompilations, which depend
    # on what ran before in the process, are warnings)
    assert not [f for f in r.manifest["findings"] if f["kind"].startswith("compile.")
                and f["severity"] == "error"]
    report = compare(str(path), str(tmp_path / "tgt"))
    assert not [f for f in report.findings if f.kind.startswith("alignment.")]
    assert report.verdict == "pass", report.decided_by
