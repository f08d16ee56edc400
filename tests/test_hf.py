"""Hugging Face checkpoints in and out, against transformers itself: tiny random models made here
(no download) for every supported model type and both config.json layouts.

Needs the reference extra (torch, transformers): ``pip install -c constraints.txt -e
'.[hf-reference]'``. Without it these tests skip, except under CI (``CI`` set), where they fail
(tests/hf_reference.py, which imports torch on first use).
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_reference import (
    IDS,
    KINDS,
    VOCAB,
    Reference,
    byte_tokenizer,
    greedy_reference,
    libraries,
    reference_logits,
)
from support import GPT_FAMILY, LlamaTrainer, LlamaTrainerConfig, invoke

import theseus
from theseus.config import apply_overrides, load_yaml
from theseus.data import Sampler, load_corpus
from theseus.data.packing import MaskedExamples, build_rows, pack
from theseus.hf.exporter import export_hf, tensor_blocks
from theseus.hf.importer import import_hf
from theseus.inference.logits import load_run
from theseus.plot import read_metrics
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.topology import Topology
from theseus.training.run.loop import train
from theseus.training.run.mode import RunMode
from theseus.training.trainer import next_token_loss


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict[str, Reference] = {}

    def get(kind: str) -> Reference:
        if kind not in cache:
            cache[kind] = Reference(kind, tmp_path_factory.mktemp(kind) / "hf")
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def imported(references, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            out = tmp_path_factory.mktemp(kind) / "run"
            import_hf(references(kind).directory, out)
            cache[kind] = out
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "llama-bf16"])
def test_logits_match_transformers(kind, references, imported, caplog):
    """One device, and tp=2 + FSDP on 8: within 1e-4 of transformers' float32 logits; no
    library warnings on the way (orbax's about read-only restores)."""
    run = imported(kind)
    caplog.set_level("WARNING")
    want = references(kind).logits
    one = theseus.logits(run, IDS, devices=jax.devices()[:1])
    assert one.dtype == np.float32 and one.shape == (*IDS.shape, VOCAB)
    np.testing.assert_allclose(one, want, atol=1e-4, rtol=0)
    sharded = theseus.logits(run, IDS, policy_changes={"tp": 2, "fsdp": True})
    np.testing.assert_allclose(sharded, want, atol=1e-4, rtol=0)
    assert not [r for r in caplog.records if r.name == "absl"], caplog.text


@pytest.mark.parametrize(
    "kind",
    [
        "llama31-4.x",
        "qwen2",
        "qwen2-window",
        "qwen3",
        "olmo2",
        "gemma2",
        "gemma3",
        "gpt2",
        "llama-bf16",
    ],
)
def test_export_loads_back_bit_identical(kind, references, imported, tmp_path):
    """import → export writes every tensor bit for bit; transformers loads it with no missing or
    unexpected keys and its logits are the original's within 1e-5."""
    lib = libraries()
    torch, load_file = lib.torch, lib.load_file
    reference = references(kind)
    out = tmp_path / "hf"
    max_shard = "20KB" if kind == "llama31-4.x" else "5GB"  # several shards and an index
    export_hf(imported(kind), out, max_shard_size=max_shard)
    assert (out / "tokenizer.json").is_file()
    if kind == "llama31-4.x":
        assert (out / "model.safetensors.index.json").is_file()
    original = load_file(reference.directory / "model.safetensors")
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype, name
        assert torch.equal(written[name].view(torch.uint8), tensor.view(torch.uint8)), name
    loaded, info = lib.transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = reference_logits(loaded.float().eval(), IDS)
    np.testing.assert_allclose(got, reference.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama31", "qwen2", "qwen3", "mistral", "olmo2", "gpt2"])
def test_greedy_generation_matches_transformers(kind, references, imported):
    """Greedy tokens equal transformers' (Mistral: prompts and generation past its window)."""
    prompts = [[5, 17, 200, 3], [99, 1, 250, 42, 7, 64]]
    model = references(kind).model
    result = theseus.generate(
        imported(kind),
        prompts,
        max_new_tokens=6,
        temperature=0.0,
        policy_changes={"tp": 2},
    )
    for prompt, completion in zip(prompts, result.completions, strict=True):
        assert completion.prompt_ids == prompt
        assert completion.token_ids == greedy_reference(model, prompt, 6)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_generates_past_its_window(kind, references, imported):
    """16 greedy tokens past a prompt of 6 (the window is 4) under tp=2 equal transformers'."""
    prompt = [99, 1, 250, 42, 7, 64]
    result = theseus.generate(
        imported(kind), [prompt], max_new_tokens=16, temperature=0.0, policy_changes={"tp": 2}
    )
    assert result.completions[0].token_ids == greedy_reference(references(kind).model, prompt, 16)


def test_text_weights_of_a_gemma3_folder(tmp_path):
    """A Gemma3ForConditionalGeneration folder (with its vision tower, as transformers saves it)
    imports as its language model: theseus.logits equals transformers' on text within 1e-4."""
    lib = libraries()
    torch, transformers = lib.torch, lib.transformers
    text = KINDS["gemma3"][0](transformers).to_dict()
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "hf")
    result = invoke("import-hf", tmp_path / "hf", tmp_path / "run")
    assert result.exit_code == 0 and "gemma3" in result.output, result.output
    got = theseus.logits(tmp_path / "run", IDS, devices=jax.devices()[:1])
    np.testing.assert_allclose(got, reference_logits(model, IDS), atol=1e-4, rtol=0)


def test_generate_cli_reads_the_job_from_the_run(imported):
    result = invoke(
        "generate", imported("qwen3"), "--prompt-ids", "5,17,200", "--temperature", "0",
        "--max-new-tokens", "3", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "token_ids" in result.output


# --- bad input: exit 2, one paragraph, no traceback, nothing written --------------------------


def _hf_copy(references, tmp_path: Path, kind: str = "llama") -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(references(kind).directory, folder)
    return folder


def _config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _drop_tensor(folder: Path, name: str) -> None:
    lib = libraries()
    tensors = lib.load_file(folder / "model.safetensors")
    del tensors[name]
    lib.save_file(tensors, folder / "model.safetensors")


def _truncate(folder: Path) -> None:
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])


BAD_INPUTS = {
    "unknown": (lambda f: _config(f, model_type="deepseek_v3"), ["'deepseek_v3'", "qwen3"]),
    "experts": (lambda f: _config(f, num_local_experts=8), ["experts", "num_local_experts"]),
    "rope": (
        lambda f: _config(f, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
        ["yarn"],
    ),
    "missing": (
        lambda f: _drop_tensor(f, "model.layers.1.mlp.up_proj.weight"),
        ["model.layers.1.mlp.up_proj.weight is missing", "(56, 48)"],
    ),
    "misshapen": (
        lambda f: _config(f, intermediate_size=60),
        ["model.layers.0.mlp.gate_proj.weight", "(56, 48)", "(60, 48)"],
    ),
    "truncated": (_truncate, ["model.safetensors is truncated"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_import_bad_input_is_one_paragraph(case, references, tmp_path):
    damage, expected = BAD_INPUTS[case]
    folder = _hf_copy(references, tmp_path)
    damage(folder)
    out = tmp_path / "run"
    result = invoke("import-hf", folder, out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ") and result.output.strip().count("\n") == 0
    for text in expected:
        assert text in result.output, result.output
    assert not out.exists()


def test_import_never_touches_an_existing_run(references, imported, tmp_path):
    run = imported("llama")
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    result = invoke("import-hf", references("qwen2").directory, run)
    assert result.exit_code == 2 and "already exists" in result.output, result.output
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


# --- fine-tuning an imported model -------------------------------------------------------------

FINE_TUNE = [
    "training.seq_len=16",
    "training.batch_size=16",
    "training.steps=4",
    "optimization.learning_rate=3e-3",
    "optimization.warmup_steps=1",
    "training.validation_interval=4",
    "training.validation_batches=1",
    "checkpointing.interval=4",
    "logging.progress_bar=false",
]


def test_init_from_imported_model_under_tp2_fsdp(imported, tmp_path):
    """The first step's loss under tp=2 + FSDP on 8 devices equals one device's (1e-5
    relative); it is the imported model's loss, not a fresh one's; training lowers it."""
    run = imported("llama")
    model = load_yaml(LlamaTrainerConfig, run / "config.yaml").model

    def fine_tune(policy, per_device, devices, name):
        config = apply_overrides(
            LlamaTrainerConfig(model=model),
            [*FINE_TUNE, f"training.per_device_batch_size={per_device}"],
        )
        trainer = LlamaTrainer(config, policy, Topology.new(policy, devices))
        train(trainer, tmp_path / name, mode=RunMode(init_from=run))
        return [row["loss"] for row in read_metrics(tmp_path / name)]

    one = fine_tune(ShardingPolicy(), 16, jax.devices()[:1], "one")
    sharded = fine_tune(ShardingPolicy(tp=2, fsdp=True), 2, None, "sharded")
    np.testing.assert_allclose(sharded[0], one[0], rtol=1e-5)
    # The imported model's own loss on the first batch (one device: no accumulation).
    batch = Sampler(load_corpus(None).train, 16, seed=0).global_batch(0, 1, 16)[0]  # (16, 17)
    scores = theseus.logits(run, batch[:, :-1], devices=jax.devices()[:1])
    np.testing.assert_allclose(one[0], float(next_token_loss(scores, batch[:, 1:])), rtol=1e-5)
    assert sharded[-1] < sharded[0]


def test_mistral_trains_at_four_times_its_window(references, imported, tmp_path):
    """training.seq_len=16, four times Mistral's window of 4: the first step's loss is
    transformers' windowed loss on that batch (1e-5 relative)."""
    run = imported("mistral")
    model = load_yaml(LlamaTrainerConfig, run / "config.yaml").model
    steps = ["training.steps=1", "training.per_device_batch_size=16", "checkpointing.interval=1"]
    config = apply_overrides(
        LlamaTrainerConfig(model=model),
        [*FINE_TUNE, *steps, "training.validation_interval=1"],
    )
    trainer = LlamaTrainer(
        config, ShardingPolicy(), Topology.new(ShardingPolicy(), jax.devices()[:1])
    )
    train(trainer, tmp_path / "run", mode=RunMode(init_from=run))
    losses = [row["loss"] for row in read_metrics(tmp_path / "run")]
    batch = Sampler(load_corpus(None).train, 16, seed=0).global_batch(0, 1, 16)[0]  # (16, 17)
    scores = reference_logits(references("mistral").model, batch[:, :-1])  # (16, 16, vocab)
    expected = float(next_token_loss(scores, batch[:, 1:]))
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)


def test_init_from_another_model_names_the_fields(imported, tmp_path):
    """--init-from takes the base's model: an override that contradicts it is refused, naming
    each field with both values, before anything is restored or written."""
    base = imported("qwen3")
    hidden = load_yaml(LlamaTrainerConfig, base / "config.yaml").model.hidden_size
    result = invoke(
        "train", "--job", "llama/train/pretrain", "--init-from", base,
        "--out", tmp_path / "run", "--steps", "1", *FINE_TUNE[:2],
        f"model.hidden_size={hidden + 16}", "training.per_device_batch_size=2",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
    assert f"model.hidden_size={hidden + 16} (the base's: {hidden})" in result.output


def test_export_blocks_rebuild_each_tensor(imported):
    """Export gathers a tensor in blocks of rows; small blocks give the same bytes."""
    loaded = load_run(imported("gpt2"), layout="storage")
    model = loaded.trainer.config.model.model_dump(mode="json")
    for tensor in GPT_FAMILY.hf.tensors(model)[:8]:  # c_attn among them
        whole = np.concatenate(list(tensor_blocks(loaded.params, tensor, np.float32)))
        small = list(tensor_blocks(loaded.params, tensor, np.float32, block_bytes=100))
        assert len(small) > 1 or len(tensor.shape) == 1
        np.testing.assert_array_equal(np.concatenate(small), whole)
        assert whole.shape == tensor.shape


def test_export_bad_input_is_one_paragraph(imported, tmp_path):
    run = imported("qwen2")
    cases = [
        (["--dtype", "float16"], "export writes float32 or bfloat16"),
        (["--max-shard-size", "lots"], "'lots' is not a byte count; write e.g. 80GiB"),
    ]
    for flags, expected in cases:
        result = invoke("export-hf", run, tmp_path / "out", *flags)
        assert result.exit_code == 2 and expected in result.output, result.output
        assert not (tmp_path / "out").exists()
    result = invoke("export-hf", tmp_path, tmp_path / "out")
    assert result.exit_code == 2 and "holds no checkpoints/ folder" in result.output


def test_init_from_contradictions(imported, tmp_path):
    with pytest.raises(ValueError, match="choose one"):
        RunMode(resume=True, init_from=imported("llama"))
    with pytest.raises(ValueError, match="holds no checkpoints/ folder"):
        RunMode(init_from=tmp_path)
    result = invoke("train", "--init-from", tmp_path, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "--init-from" in result.output, result.output


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_loss_is_the_token_weighted_mean_of_transformers_losses(kind, references, imported):
    """Conversations of random ids with masked spans, packed into rows: theseus's loss over the
    trained tokens equals transformers' per-example losses (labels -100 outside the mask, each
    example alone, float32) weighted by their trained tokens."""
    torch = libraries().torch
    rng = np.random.default_rng(1)
    lengths = rng.integers(6, 30, 9)  # (examples,)
    ids = [rng.integers(0, VOCAB, n) for n in lengths]
    masks = [(rng.random(n) < 0.5).astype(np.uint8) for n in lengths]
    data = MaskedExamples(np.concatenate(ids), np.concatenate(masks), lengths.astype(np.int64))
    packing = pack(data.lengths, 48, seed=0, overlong="error", where="test")
    rows = build_rows(data, packing, np.arange(packing.num_rows))  # (rows, 3, 48)
    assert packing.num_rows < len(lengths)  # rows hold several examples
    loaded = load_run(imported(kind), layout="storage", devices=jax.devices()[:1])
    got = float(loaded.trainer.validation_step(loaded.params, rows[None])["loss"])
    model, total, count = references(kind).model, 0.0, 0
    for example, mask in zip(ids, masks, strict=True):
        labels = np.where(mask == 1, example, -100)
        with torch.no_grad():
            out = model(torch.tensor(example[None]), labels=torch.tensor(labels[None]))
        trained = int(mask[1:].sum())  # the first token is no target
        total, count = total + float(out.loss) * trained, count + trained
    np.testing.assert_allclose(got, total / count, rtol=1e-5)


CHAT = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def test_generate_chat_replies_as_transformers(references, imported, tmp_path):
    """`theseus generate --chat`: the prompt rendered with the folder's template and the
    generation prompt, the greedy reply cut at the end-of-turn token, as transformers'
    apply_chat_template and generate(eos_token_id=...) give them."""
    lib = libraries()
    model = references("llama").model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    prompt = byte_tokenizer().encode(rendered).ids
    free = greedy_reference(model, prompt, 10)  # where the reply goes without a stop
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copyfile(imported("llama") / "tokenizer.json", folder / "tokenizer.json")
    stop_token = byte_tokenizer().id_to_token(stop)
    config = {"eos_token": stop_token, "chat_template": CHAT}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf = lib.transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token=stop_token
    )
    ids = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=CHAT
    )
    assert list(ids) == prompt
    with lib.torch.no_grad():
        out = model.generate(
            lib.torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=stop
        )
    want = out[0, len(prompt) :].tolist()
    assert want == free[: free.index(stop) + 1]  # transformers stopped at the end of the turn
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    args = ("generate", imported("llama"), "--messages", path, "--tokenizer", folder)
    result = invoke(*args, "--temperature", "0", "--max-new-tokens", "40", "--json")
    assert result.exit_code == 0, result.output
    (reply,) = json.loads(result.stdout)["replies"]
    assert reply["prompt_ids"] == prompt and reply["token_ids"] == want and reply["stopped"]
    assert json.loads(result.stdout)["new_tokens"] <= 16  # decoding ended at the stop
    assert reply["reply"] == hf.decode(want[:-1])
    printed = invoke(*args, "--temperature", "0", "--max-new-tokens", "10")
    assert printed.exit_code == 0 and printed.stdout == reply["reply"] + "\n", printed.output
