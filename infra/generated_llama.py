"""The GPU check's model (infra/gpu_check.py): a Llama generated from a seed, with a byte-level tokenizer trained on
generated sentences, saved as a model source folder: nothing is downloaded, so it runs on a bare borrowed image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GeneratedBase:
    prepared: Any  # tasks.inputs.load.PreparedBase
    facts: dict[str, Any]
    probe: list[list[int]]  # token sequences whose logits every technique is compared on
    calibration: list[str]  # the calibration split of techniques that calibrate (generated sentences)


def generated_llama(folder: Path, tiny: bool) -> GeneratedBase:
    """A random Llama whose output layer is scaled so its logits are far from uniform (a quantizer's damage shows),
    with a byte-level tokenizer trained on generated sentences, saved as a model source folder."""
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.inputs.load import PreparedBase
    from tasks.local_files import folder_sha256

    rng = random.Random(0)
    words = ["river", "stone", "garden", "winter", "market", "letter", "bridge", "forest", "village", "music"]
    text = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    vocab = 320 if tiny else 4096
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text, trainer)
    shape = (
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
        if tiny
        else {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 20,
            "num_attention_heads": 16,
        }
    )
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        num_key_value_heads=shape["num_attention_heads"] // 2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked next-token distributions instead of near-uniform ones
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    probe_ids = tokenizer.encode(" ".join(text[:200])).ids
    probe = [probe_ids[i : i + 64] for i in range(0, 256, 64)]
    if len(probe[-1]) != 64:
        raise RuntimeError("the generated text tokenizes to fewer than 256 tokens")
    facts = {"parameters": sum(p.numel() for p in model.parameters()), **shape, "vocab": config.vocab_size}
    calibration = [" ".join(text[i : i + 20]) for i in range(200, 400, 20)]
    return GeneratedBase(PreparedBase(folder, folder_sha256(folder), "generated"), facts, probe, calibration)
