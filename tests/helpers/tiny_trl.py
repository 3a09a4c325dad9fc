"""A tiny local TRL setup: a word-level tokenizer built in code, a random Qwen3, a prompt set;
and for vision-language GRPO and SFT a Qwen2-VL processor built the same way, with image prompts.

Nothing is downloaded. :func:`run_grpo` trains ``trl.GRPOTrainer`` or a subclass for a few
optimizer steps and returns what a side-by-side comparison needs.
"""

from __future__ import annotations

import random
from typing import Any

import torch

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def tiny_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast`` (pad 0, eos 1), left padding for prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def tiny_model(seed: int = 0, vocab: int = len(SPECIAL) + len(WORDS), hidden: int = 32, layers: int = 2) -> Any:
    """A random Qwen3 causal LM, fp32, sdpa attention, identical for one seed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def prompts(n: int, length: int, seed: int = 0) -> list[str]:
    """n distinct prompts of ``length`` words each."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(n)]


def reward_len(completions: list[Any], **kwargs: Any) -> list[float]:
    """In-code reward: shorter completions with more 'w1' score higher (anything non-constant).

    A completion is a string, or (conversational prompts) a list of messages.
    """
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [t.count("w1") - 0.1 * len(t.split()) for t in texts]


def tiny_vl_processor() -> Any:
    """A Qwen2-VL processor over a word-level tokenizer whose ids match :func:`helpers.vlm.tiny_vlm`.

    Every id of the model's vocabulary is a word (``w0`` ...) except pad 0, eos 1, unk 2 and
    the vision tokens at the ids the tiny models use. Images are resized to multiples of 4
    pixels (patch 2, merge 2) between 16 and 256 pixels: an RGB 16x16 image is an [8, 8] grid
    of patches, 16 placeholder tokens. The chat template writes an image part as
    ``<|vision_start|><|image_pad|><|vision_end|>``, text parts as they are, and ``w0`` as
    the generation prompt. The processor has no video processor (it needs torchvision).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from helpers import vlm

    vision = {
        vlm.IMAGE_TOKEN: "<|image_pad|>",
        vlm.VISION_START: "<|vision_start|>",
        vlm.VISION_END: "<|vision_end|>",
        vlm.VIDEO_TOKEN: "<|video_pad|>",
    }
    names = [vision.get(i, f"w{i - len(SPECIAL)}") for i in range(vlm.VOCAB)]
    names[: len(SPECIAL)] = SPECIAL
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=list(vision.values()),
    )
    fast.padding_side = "left"
    template = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
        "{% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}"
        "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}w0 {% endif %}"
    )

    class ImageOnlyProcessor(Qwen2VLProcessor):
        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any
        ) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

    images = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=256)
    return ImageOnlyProcessor(image_processor=images, tokenizer=fast, chat_template=template)


def vl_dataset(seed: int = 0) -> Any:
    """Conversational image prompts: three share one text over three different 16x16 images
    (identical token ids, different images), a fourth has other text over the first image."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    imgs = [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(3)]
    same, other = prompts(2, 8, seed=seed)
    rows = [(same, imgs[0]), (same, imgs[1]), (other, imgs[0]), (same, imgs[2])]
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": t}] for t, _ in rows], "image": [i for _, i in rows]}
    )


def run_grpo(
    trainer_cls: type,
    *,
    steps: int = 3,
    lora: bool = False,
    between_steps: Any = None,
    before_train: Any = None,
    workdir: str,
    model_path: str | None = None,
    train_dataset: Any = None,
    processing_class: Any = None,
    **config: Any,
) -> dict[str, Any]:
    """Train ``trainer_cls`` (GRPOTrainer or a subclass) for ``steps`` optimizer steps.

    Args:
        trainer_cls: the trainer class; extra constructor keywords go in ``config["trainer_kwargs"]``.
        steps: optimizer steps (``max_steps``).
        lora: wrap the model in a LoRA adapter (peft); ``config["peft_config"]``: another PEFT config.
        between_steps: callable(trainer) run after every optimizer step (a callback).
        before_train: callable(trainer) run once the trainer is built, before ``train()``.
        workdir: output directory.
        model_path: a saved :func:`tiny_model` (processes of one run share it); default: saved here.
        train_dataset: default: 8 text prompts of 20 words.
        processing_class: default: :func:`tiny_tokenizer`.
        **config: ``GRPOConfig`` fields over the defaults below.

    Returns:
        {"loss": [steps], "grad_norm": [steps], "completions": [...], "rewards": [...],
        "logs": log_history, "trainer": the trainer}.
    """
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    trainer_kwargs = config.pop("trainer_kwargs", {})
    peft_config = config.pop("peft_config", None)
    seen: list[tuple[str, float]] = []

    def reward(completions: list[str], **kw: Any) -> list[float]:
        r = reward_len(completions)
        seen.extend(zip(completions, r))
        return r

    base = dict(
        output_dir=workdir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        # SGD, not Adam: Adam divides each update by the root of its second moment, so the
        # rounding noise of a near-zero gradient entry becomes an update of order lr, and after
        # two steps two legal summation orders (packed vs stock, or AVX2 vs AVX512 kernels)
        # differ beyond rounding (1.2e-5 relative in grad_norm at step 3 on AVX512). With SGD
        # the later steps stay at rounding level (about 1e-7) while lr 0.1 still moves the
        # model (step 3's grad_norm 1.4% away from a run at lr 0).
        optim="sgd",
        learning_rate=1e-1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        bf16=False,
        temperature=1.0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(config)
    args = GRPOConfig(**base)
    # Passed as a local path: with beta > 0 TRL loads the reference from the policy's path.
    model = model_path
    if model is None:
        model = f"{workdir}/init"
        tiny_model().save_pretrained(model)
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    callbacks = []
    if between_steps is not None:

        class _Between(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                between_steps(trainer)

        callbacks.append(_Between())
    ds = Dataset.from_dict({"prompt": prompts(8, 20)}) if train_dataset is None else train_dataset
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tiny_tokenizer() if processing_class is None else processing_class,
        peft_config=peft_config,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    if before_train is not None:
        before_train(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "completions": [c for c, _ in seen],
        "rewards": [r for _, r in seen],
        "logs": trainer.state.log_history,
        "trainer": trainer,
    }


def run_sft(
    trainer_cls: type,
    *,
    workdir: str,
    steps: int = 3,
    model: Any = None,
    train_dataset: Any = None,
    processing_class: Any = None,
    callbacks: Any = None,
    **config: Any,
) -> dict[str, Any]:
    """Train ``trainer_cls`` (SFTTrainer or a subclass) on prompt/completion pairs, 4 completions per prompt.

    Args:
        model, train_dataset, processing_class: default :func:`tiny_model`, 6 prompts of 24
            words with 4 completions each, :func:`tiny_tokenizer` (right padding).
        callbacks: ``TrainerCallback`` list.
        **config: ``SFTConfig`` fields over the defaults below; ``config["peft_config"]``: a PEFT config.

    Returns:
        {"loss": [steps], "grad_norm": [steps], "logs": log_history, "trainer": the trainer}.
    """
    from datasets import Dataset
    from trl import SFTConfig

    trainer_kwargs = config.pop("trainer_kwargs", {})
    peft_config = config.pop("peft_config", None)
    rng = random.Random(1)
    ps, cs = [], []
    for p in prompts(6, 24, seed=3):
        for _ in range(4):
            ps.append(p)
            cs.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))))
    if train_dataset is None:
        train_dataset = Dataset.from_dict({"prompt": ps, "completion": cs})
    base = dict(
        output_dir=workdir,
        per_device_train_batch_size=8,
        max_steps=steps,
        # SGD, not Adam: Adam divides each update by the root of its second moment, so the
        # rounding noise of a near-zero gradient entry becomes an update of order lr, and after
        # two steps two legal summation orders (packed vs stock, or AVX2 vs AVX512 kernels)
        # differ beyond rounding (1.2e-5 relative in grad_norm at step 3 on AVX512). With SGD
        # the later steps stay at rounding level (about 1e-7) while lr 0.1 still moves the
        # model (step 3's grad_norm 1.4% away from a run at lr 0).
        optim="sgd",
        learning_rate=1e-1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        bf16=False,
    )
    base.update(config)
    if processing_class is None:
        processing_class = tiny_tokenizer()
        processing_class.padding_side = "right"
    trainer = trainer_cls(
        model=tiny_model() if model is None else model,
        args=SFTConfig(**base),
        train_dataset=train_dataset,
        processing_class=processing_class,
        callbacks=callbacks,
        peft_config=peft_config,
        **trainer_kwargs,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "logs": trainer.state.log_history,
        "trainer": trainer,
    }


def vl_sft_dataset(seed: int = 0, messages: bool = False) -> Any:
    """Image prompt/completion samples for SFT, as plain text with the Qwen image part.

    One text over three different 16x16 images: three samples hold image 0 (three
    completions), two hold image 1 and one holds image 2 (the same prompt ids as image 0's
    samples, different images), and one holds image 0 under another text. ``messages=True``:
    the same samples as conversations (TRL's language-modeling collator: every token,
    image placeholders included, carries a label).
    """
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    imgs = [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(3)]
    same, other = ("<|vision_start|><|image_pad|><|vision_end|> " + p for p in prompts(2, 8, seed=seed))
    rows = [(same, 0), (same, 0), (same, 0), (same, 1), (same, 1), (same, 2), (other, 0)]
    r = random.Random(seed)
    completions = [" ".join(r.choice(WORDS) for _ in range(r.randint(2, 5))) for _ in rows]
    if messages:
        chats = [
            [{"role": "user", "content": t.split("> ", 1)[1]}, {"role": "assistant", "content": c}]
            for (t, _), c in zip(rows, completions)
        ]
        return Dataset.from_dict({"messages": chats, "image": [imgs[i] for _, i in rows]})
    return Dataset.from_dict(
        {"prompt": [t for t, _ in rows], "completion": completions, "image": [imgs[i] for _, i in rows]}
    )


def group_shuffle_reference(batch: dict[str, Any]) -> dict[str, Any]:
    """The keep-groups shuffle written from its rule, loop by loop (the tests' reference).

    One ``torch.randperm(B)`` (TRL's draw), then the prompt groups (rows with the same
    unpadded prompt ids) in the order their first row lands in the draw, each group's rows
    in drawn order. Tensors and lists are permuted; None and 0-dim tensors kept.
    """
    B = len(next(v for v in batch.values() if v is not None))
    perm = torch.randperm(B).tolist()
    rows: dict[tuple, list[int]] = {}
    for i in perm:
        key = tuple(batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist())
        rows.setdefault(key, []).append(i)
    order = [i for group in rows.values() for i in group]
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = v[torch.tensor(order)]
        else:
            out[k] = [v[i] for i in order]
    return out


def tiny_reward_model(seed: int = 0, vocab: int = len(SPECIAL) + len(WORDS), hidden: int = 32) -> Any:
    """A random Qwen3 reward model (``Qwen3ForSequenceClassification``, one label, pad 0), fp32."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        num_labels=1,
    )
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(cfg).float()
    with torch.no_grad():
        model.score.weight.normal_(0, 0.3)  # scores of order 1: the pairwise loss and its gradients are not flat
    return model


def run_reward(trainer_cls: type, *, workdir: str, steps: int = 3, model: Any = None, **config: Any) -> dict[str, Any]:
    """Train ``trainer_cls`` (RewardTrainer or a subclass) on preference pairs: 8 prompts of 20 words,
    a chosen and a rejected completion of 2 to 6 words each (TRL appends EOS).

    Returns:
        {"loss": [steps], "grad_norm": [steps], "logs": log_history, "trainer": the trainer}.
    """
    from datasets import Dataset
    from trl import RewardConfig

    trainer_kwargs = config.pop("trainer_kwargs", {})
    rng = random.Random(2)
    words = lambda: " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))  # noqa: E731
    ps = prompts(8, 20, seed=5)
    data = Dataset.from_dict({"prompt": ps, "chosen": [words() for _ in ps], "rejected": [words() for _ in ps]})
    base = dict(
        output_dir=workdir,
        per_device_train_batch_size=4,
        max_steps=steps,
        optim="sgd",  # as run_sft: SGD keeps later steps at rounding level
        learning_rate=1e-1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        center_rewards_coefficient=0.01,
    )
    base.update(config)
    tok = tiny_tokenizer()
    tok.padding_side = "right"
    trainer = trainer_cls(
        model=tiny_reward_model() if model is None else model,
        args=RewardConfig(**base),
        train_dataset=data,
        processing_class=tok,
        **trainer_kwargs,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h["grad_norm"] for h in logs],
        "logs": trainer.state.log_history,
        "trainer": trainer,
    }
