"""Mixture-of-experts checkpoints in and out, against transformers: tiny random Qwen3-MoE, OLMoE
and Mixtral models made here (float32, 4 experts, 2 per token), imported and compared on logits,
the experts each token selects, the load-balancing loss and greedy generation; exported bit for
bit; a tensor the model does not read refused. Skips without the reference extra
(tests/hf_reference.py)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import IDS, MOE_KINDS, Reference, greedy_reference, libraries, reference_logits
from support import invoke

import theseus
from theseus.hf.exporter import export_hf
from theseus.hf.importer import import_hf
from theseus.inference.logits import load_run
from theseus.model.attention import AttentionMask
from theseus.model.decoder import Attended, LayerInputs, layer_runs, run_length
from theseus.model.experts import aux_loss
from theseus.model.parts import arrays


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe(request, tmp_path_factory):
    """Each family's transformers reference and its import."""
    kind = request.param
    reference = Reference(kind, tmp_path_factory.mktemp(kind) / "hf")
    run = tmp_path_factory.mktemp(f"{kind}_run") / "run"
    import_hf(reference.directory, run)
    return reference, run


def _model(run):
    loaded = load_run(run, devices=jax.devices()[:1])
    return nnx.merge(loaded.trainer.graphdef, loaded.params)


def _choices(model, ids: np.ndarray) -> list[np.ndarray]:
    """Each layer's chosen experts (tokens, top_k), running the skeleton's layers one by one
    (compiled: op by op, the expert blocks cost seconds)."""
    sk = model.skeleton
    chosen = jax.jit(lambda w, ids: _layer_choices(sk, w, ids))(arrays(model.weights()), ids)
    return [np.asarray(c) for c in chosen]


def _layer_choices(sk, w, ids: jax.Array) -> list[jax.Array]:
    positions = jnp.arange(ids.shape[1])[None]
    x = sk.embed(w, ids, positions, sk.settings)
    features = sk.features(positions, sk.settings)
    layers = [
        jax.tree.map(lambda a, i=i: a[i], run)
        for run in layer_runs(w.layers)
        for i in range(run_length(run))
    ]  # each layer's weights, in layer order (runs of one type each)
    data = sk.per_layer.data(len(layers))
    chosen = []
    for index, layer in enumerate(layers):
        layer_data = jax.tree.map(lambda a, i=index: a[i], data)
        mask = AttentionMask(positions, positions, None, None, window=layer_data.window)

        def attend(q, k, v, keep=None, mask=mask):
            return Attended(sk.attend(q, k, v, mask))

        out = sk.layer(layer, x, LayerInputs(attend, features, None, layer_data), sk.settings)
        if out.routing is not None:  # a layer with experts
            chosen.append(out.routing.experts)
        x = out.stream
    return chosen


def test_moe_matches_transformers(moe):
    """Logits within 2e-5 of the largest logit on one device and under tp=2 + FSDP with experts
    over shard; the experts
    of every untied token equal transformers'; the load-balancing loss within 1e-6 relative."""
    reference, run = moe
    torch = libraries().torch
    want = reference.logits
    scale = 2e-5 * np.abs(want).max()
    one = theseus.logits(run, IDS, devices=jax.devices()[:1])
    np.testing.assert_allclose(one, want, atol=scale, rtol=0)
    sharded = theseus.logits(run, IDS, policy_changes={"tp": 2, "fsdp": True, "experts": "shard"})
    np.testing.assert_allclose(sharded, want, atol=scale, rtol=0)

    with torch.no_grad():
        out = reference.model(torch.tensor(IDS), output_router_logits=True)
    top_k = reference.model.config.num_experts_per_tok
    model = _model(run)
    compared = 0
    for got, logits in zip(_choices(model, IDS), out.router_logits, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        ranked = torch.sort(probs, dim=-1, descending=True).values.numpy()
        untied = ranked[:, top_k - 1] - ranked[:, top_k] > 1e-6  # (tokens,)
        theirs = torch.topk(probs, top_k, dim=-1).indices.numpy()
        assert untied.mean() > 0.9
        np.testing.assert_array_equal(np.sort(got, -1)[untied], np.sort(theirs, -1)[untied])
        compared += int(untied.sum())
    assert compared > 0
    sums = nnx.jit(lambda m, ids: m.outputs(ids))(model, jnp.asarray(IDS)).routing
    ours = float(aux_loss(sums, sums.counts, sums.rows))
    np.testing.assert_allclose(ours, float(out.aux_loss), rtol=1e-6)


def test_moe_generates_as_transformers(moe):
    """Greedy generation of 16 tokens through the KV cache equals transformers'."""
    reference, run = moe
    prompts = [[5, 17, 200, 3], [99, 1, 250, 42, 7, 64]]
    result = theseus.generate(run, prompts, max_new_tokens=16, temperature=0.0)
    for prompt, completion in zip(prompts, result.completions, strict=True):
        assert completion.token_ids == greedy_reference(reference.model, prompt, 16)


def test_moe_export_is_bit_identical(moe, tmp_path):
    """import → export writes every tensor (one per expert) bit for bit; transformers loads it
    with no missing or unexpected keys."""
    lib = libraries()
    reference, run = moe
    export_hf(run, tmp_path / "hf")
    original = lib.load_file(reference.directory / "model.safetensors")
    written = lib.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert lib.torch.equal(written[name].view(lib.torch.uint8), tensor.view(lib.torch.uint8))
    loaded, info = lib.transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = reference_logits(loaded.float().eval(), IDS)
    np.testing.assert_allclose(got, reference.logits, atol=1e-5, rtol=0)


def test_a_tensor_the_model_does_not_read_is_refused(moe, tmp_path):
    """A fifth expert's tensor in a folder whose config says four: import names it, writes
    nothing."""
    lib = libraries()
    reference, _ = moe
    folder = tmp_path / "hf"
    shutil.copytree(reference.directory, folder)
    tensors = lib.load_file(folder / "model.safetensors")
    last = next(name for name in sorted(tensors) if ".experts.3." in name)
    extra = last.replace(".experts.3.", ".experts.4.")
    tensors[extra] = tensors[last].clone()
    lib.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=extra.replace(".", r"\.")):
        import_hf(folder, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_fused_layout_imports_to_the_same_run(moe, tmp_path):
    """transformers 5's fused experts (``mlp.experts.gate_up_proj``, ``down_proj``: its
    modules' state as it holds it in memory) import to the parameters of the per-expert
    folder, bit for bit."""
    lib = libraries()
    reference, run = moe
    folder = tmp_path / "hf"
    shutil.copytree(reference.directory, folder)
    state = {k: v.contiguous() for k, v in reference.model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    lib.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    import_hf(folder, tmp_path / "run")
    fused, per_expert = (
        load_run(r, devices=jax.devices()[:1]).params for r in (tmp_path / "run", run)
    )
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(per_expert), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_plan_counts_the_parameters_transformers_has(moe):
    """`theseus plan --hf` of the folder counts transformers' parameters (dense layers' MLPs
    and expert layers' blocks alike); under FSDP every layer's weights, each run's, are gathered
    one layer at a time in the layer scan."""
    reference, run = moe
    result = invoke("plan", "--hf", reference.directory, "--devices", "8", "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    want = sum(p.numel() for p in reference.model.parameters())
    assert json.loads(result.output)["num_params"] == want
    policy = {"tp": 2, "fsdp": True, "experts": "shard"}
    trainer = load_run(run, policy_changes=policy).trainer
    projections = {
        leaf.path
        for leaf in trainer.abstract_leaves
        if leaf.path.startswith("layers/") and leaf.path.endswith("proj/weight")
    }  # every run's, e.g. layers/runs/0/q_proj/weight
    assert projections and projections <= trainer.per_layer_paths
