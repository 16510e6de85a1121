"""A local model folder shaped like a hub chat model, built offline: a random-initialised Qwen3 (head_dim 64,
which vLLM's CPU kernels take), a byte-level BPE tokenizer trained here over ASCII text with the tokenizers
library, ChatML special tokens (<|endoftext|> pads, <|im_end|> ends a turn) and a chat template. It is what
`--model Qwen/...` gives the trainers, without the hub."""
import os
import random

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ "
                 "'<|im_start|>assistant\\n' }}{%- endif %}")


# a Qwen2.5-style template with tools: definitions in a system message, results as user <tool_response> turns
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n<tools>' }}{%- for t in tools %}"
    "{{ '\\n' + (t | tojson) }}{%- endfor %}{{ '\\n</tools>\\nCall one as <tool_call>{\\\"name\\\": ..., "
    "\\\"arguments\\\": {...}}</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + "
    "m['content'] + '\\n</tool_response><|im_end|>\\n' }}{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + "
    "m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{%- endif %}")


def corpus(n: int = 3000, seed: int = 0) -> list:
    """ASCII text like the prompts and answers the tests use: sums, \\boxed{} answers, a little English."""
    rng = random.Random(seed)
    words = ("what is the answer please reason step by step and put your final within so we have simplify "
             "you are a careful calculator compute sum of numbers").split()
    out = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        out.append(f"What is {a} + {b}? Put the final answer in \\boxed{{}}. {a} + {b} = \\boxed{{{a + b}}}")
        out.append(" ".join(rng.choice(words) for _ in range(8)) + f" $\\frac{{{a}}}{{{b + 1}}}$")
    return out


def build_chat_model(path: str, vocab_size: int = 512, seed: int = 0, template: str = CHAT_TEMPLATE) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(seed=seed), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
                                     model_max_length=1024)
    hf_tok.chat_template = template
    config = Qwen3Config(vocab_size=len(hf_tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=hf_tok.eos_token_id,
                         pad_token_id=hf_tok.pad_token_id,
                         bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


EVEN = "02468"  # the known reward model prefers text ending in an even digit


def build_reward_model(path: str, known: bool = False, seed: int = 0) -> str:
    """A reward model (Qwen3ForSequenceClassification, one label) with the chat model's BPE tokenizer, not
    the tiny policy's. `known`: no chat template (it reads rlmini/reward_model.py::PLAIN) and a fixed head,
    so its score is known by hand: every layer's output projections are zero (the residual stream stays the
    embedding), token t embeds as s_t * ones (s_t = +1 when its text ends in an even digit, else -1), the
    final RMSNorm's weight is 1 and the head is ones / hidden: the score is s_t / sqrt(1 + eps) of the last
    token t. Otherwise random, with the chat template."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    chat = build_chat_model(path + "-tokenizer", seed=seed)
    tok = AutoTokenizer.from_pretrained(chat)
    if known:
        tok.chat_template = None
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=512,
                         num_labels=1, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = Qwen3ForSequenceClassification(config)
    if known:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            signs = torch.tensor([1.0 if tok.decode([t])[-1:] in EVEN else -1.0 for t in range(len(tok))])
            model.model.embed_tokens.weight.copy_(signs[:, None].expand(-1, config.hidden_size))
            model.model.norm.weight.fill_(1.0)
            model.score.weight.fill_(1.0 / config.hidden_size)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# python tests/chat_model.py FOLDER: build it there (docs/own-experiment.md)
if __name__ == "__main__":
    import sys
    print(build_chat_model(sys.argv[1] if len(sys.argv) > 1 else "runs/chat-model"))
