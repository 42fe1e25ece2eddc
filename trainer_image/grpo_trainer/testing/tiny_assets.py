"""Build the tiny example's model offline: `python -m grpo_trainer.testing.tiny_assets OUTDIR`.

A random Qwen2ForCausalLM with a BPE tokenizer trained here on a built-in corpus, saved with `save_pretrained`, so
the demo, the tests and the vLLM CPU server never touch the hub. Deterministic: the same seed gives the same files.
Generated at `make demo` / test time rather than committed (the weights are binary, ~0.5 MB, and change with
transformers' serialisation).

Sizing: head_dim 32 (vLLM's CPU attention rejects 16), two layers, a vocabulary of a few hundred tokens: one learner
step takes well under a second on one core and the vLLM server loads it in its usual start-up time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The chat template TRL's response parser recognises, and the special tokens it renders. Without them in the
# vocabulary the rollout worker's child dies with "Unrecognized chat template, failed to add response schema".
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

VOCAB_SIZE = 384
HIDDEN_SIZE = 64
NUM_HEADS = 2  # head_dim = 32
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 512

# A small corpus in the shape of the prompts (examples/tiny-prompts.jsonl) plus plain words, so the BPE merges give
# whole-word tokens with and without the letter the toy reward counts.
_WORDS = [
    "apple", "banana", "cat", "dog", "egg", "fish", "goat", "hat", "ice", "jam", "kite", "lamp", "moon", "nest",
    "owl", "pear", "queen", "rat", "sun", "tree", "umbrella", "van", "water", "fox", "yak", "zebra", "red",
    "green", "blue", "black", "white", "small", "big", "happy", "sad", "fast", "slow", "one", "two", "three",
    "four", "five", "six", "seven", "eight", "nine", "ten", "say", "write", "tell", "me", "a", "story", "about",
    "the", "word", "please", "answer", "with", "letters", "name", "animal", "fruit", "color", "number", "count",
    "list", "give", "short", "long", "poem", "song",
]


def _corpus() -> list[str]:
    lines = []
    for i, word in enumerate(_WORDS):
        other = _WORDS[(i * 7 + 3) % len(_WORDS)]
        lines.append(f"say {word} and {other}")
        lines.append(f"write a short poem about the {word}")
        lines.append(f"{word} {other} {word}")
    lines.append("aaaa aaa aa a banana aardvark alpaca")
    return lines


def build_tokenizer(corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or _corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
    )
    fast.chat_template = qwen3_chat_template
    return fast


def build_model(tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny model + tokenizer to `out_dir` (atomically: a half-written model would be loaded by vLLM)."""
    out = Path(out_dir).resolve()
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + f".tmp-{os.getpid()}")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "grpo_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": len(tokenizer)}))
    return _publish(staging, out)


def _publish(staging: Path, out: Path) -> Path:
    """Move a finished build into place in one rename, so a reader never sees half a model."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(out)
    except OSError:  # another process built it meanwhile: keep theirs
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return out


#: In a prompt, makes the tiny reward model return NaN: its embedding row is NaN, and NaN reaches every later position.
# ---------------------------------------------------------------------------------------------------- tool model
#: The tool model's vocabulary: room for merges of the chat template's tool preamble, which its prompts all carry.
TOOL_VOCAB_SIZE = 1024
#: Supervised steps that teach the tool model the episode's shape (a full batch of every conversation each step).
TOOL_SFT_STEPS = 150
TOOL_SFT_LEARNING_RATE = 3e-3
#: The numbers the tool model is taught to guess, evenly: a quarter of its guesses are right.
GUESS_NUMBERS = range(4)
#: The weight, in the teaching's loss, of each prompt's one conversation answered without a guess, against its
#: conversations with a guess (one per number, weight 1): the tool model starts calling the tool in a third of its
#: episodes. Calling is what the game pays for, on every prompt alike, so the run's reward has a rise it learns within
#: its 64 groups; the targets alone (eight prompts, eight visits each) are more than the tiny model memorises there.
NO_GUESS_WEIGHT = 2.0 * len(GUESS_NUMBERS)
#: What the tool model says when it ends a turn, after the game's answer or instead of a guess.
CLOSING_WORD = "done"
#: After a wrong answer, the share of second guesses the higher/lower model is taught to send where the answer points;
#: the rest go the other way. Taught so, the model reads the answer (backwards, mostly): a run has to turn that
#: reading round, which it can learn only from the game's answers. Taught to ignore the answers, the tiny model never
#: starts to read them, in supervised steps (its second guess fits each number's overall share) or in a run.
HIGHER_LOWER_FOLLOW_SHARE = 0.2
#: The weight, in the higher/lower teaching's loss, of each generated digit (the guesses) against the other generated
#: tokens: the answer decides one token of thirty in a turn, and at weight 1 the model fits the other tokens and the
#: numbers' overall shares without ever reading the answer.
HIGHER_LOWER_DIGIT_WEIGHT = 20.0
#: The higher/lower teaching's supervised steps: the model begins to read the answer after about 200.
HIGHER_LOWER_SFT_STEPS = 300


def guess_prompts(path: str | os.PathLike) -> list[dict]:
    """The guess game's dataset rows (`examples/tiny-guess.jsonl`): a prompt and its target number."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _tool_conversations(rows: list[dict]) -> list[list[dict]]:
    """Every prompt with every guess, answered as the game server answers, then the policy's closing turn; and every
    prompt answered without a guess."""
    conversations = []
    for row in rows:
        for number in GUESS_NUMBERS:
            conversations.append([
                {"role": "user", "content": row["prompt"]},
                guess_call(number),
                {"role": "tool", "name": "guess", "content": "right" if number == row["target"] else "wrong"},
                {"role": "assistant", "content": CLOSING_WORD},
            ])
        conversations.append([{"role": "user", "content": row["prompt"]},
                              {"role": "assistant", "content": CLOSING_WORD}])
    return conversations


def _teaching_weight(conversation: list[dict]) -> float:
    return 1.0 if any("tool_calls" in message for message in conversation) else NO_GUESS_WEIGHT


def tool_chat_template(tokenizer) -> str:
    """The template TRL's worker renders a tool-using conversation with: Qwen3's own drops an earlier turn's empty
    think block once a tool answer follows, so the worker swaps in TRL's training variant, which renders every turn as
    it was generated. The tool model is taught in that rendering: its re-rendered conversation then extends the tokens
    it generated, the worker appends cleanly and trains the tool call (a re-render that rewrote it would "realign",
    and the tool call would be untrained context)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return tokenizer.chat_template if is_chat_template_prefix_preserving(tokenizer) else \
        get_training_chat_template(tokenizer)


def _tool_schema() -> list:
    from .guess_env import GuessEnvironment

    return [GuessEnvironment("http://unused").guess]  # bound, as TRL's worker passes an environment's tools


def _higher_lower_schema() -> list:
    from .higher_lower_env import HigherLowerEnvironment

    return [HigherLowerEnvironment("http://unused").guess]


def tool_training_row(tokenizer, conversation: list[dict], tools: list) -> tuple[list[int], list[int]]:
    """One conversation's tokens, rendered as the worker renders it, and its trained mask: what the policy generates
    (the template's generation spans: each assistant turn with its end-of-turn token), nothing else."""
    encoded = tokenizer.apply_chat_template(conversation, tools=tools, return_dict=True,
                                            return_assistant_tokens_mask=True,
                                            chat_template=tool_chat_template(tokenizer))
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def build_tool_tokenizer(conversations: list[list[dict]], directory: Path, seed: int = 0, tools: list | None = None):
    """The tool model's tokenizer, trained on `conversations` as the worker renders them, saved in `directory` beside
    the model's config and read back as every runtime reads it: transformers picks the tokenizer class by the model's
    type, and Qwen2's splits a digit from the space before it where the freshly trained one does not. Taught in the
    trained one's tokens, the model would generate tokens the worker's re-render never gives back."""
    from transformers import AutoTokenizer

    plain = build_tokenizer()
    template = tool_chat_template(plain)
    rendered = [plain.apply_chat_template(c, tools=tools or _tool_schema(), tokenize=False, chat_template=template)
                for c in conversations]
    trained = build_tokenizer(_corpus() + rendered, vocab_size=TOOL_VOCAB_SIZE)
    trained.save_pretrained(directory)
    build_model(trained, seed).config.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def build_tiny_tool_model(out_dir: str | os.PathLike, prompts: str | os.PathLike, seed: int = 0) -> Path:
    """The tiny model, taught offline to play `prompts`' guess game through the tool call format of its chat
    template: on every prompt, a third of the time one `guess` call with a number drawn evenly from GUESS_NUMBERS,
    then "done"; otherwise "done" with no guess (NO_GUESS_WEIGHT). Deterministic (CPU, one thread, seeded,
    full-batch steps). The reward then has something to rise from: the policy learns to play every time, and a
    quarter of its guesses are right."""
    conversations = _tool_conversations(guess_prompts(prompts))
    return _teach_tool_model(out_dir, ToolLessons(conversations, [_teaching_weight(c) for c in conversations],
                                                  _tool_schema()), seed)


@dataclass(frozen=True)
class ToolLessons:
    """What a tool model is taught: conversations, each one's weight in the loss, the tools their calls use, the
    supervised steps, and the weight of each generated digit against the other generated tokens' 1."""

    conversations: list[list[dict]]
    weights: list[float]
    tools: list
    steps: int = TOOL_SFT_STEPS
    digit_weight: float = 1.0


def _teach_tool_model(out_dir: str | os.PathLike, lessons: ToolLessons, seed: int) -> Path:
    """The tiny model with a tokenizer trained on the lessons' renderings, taught them by the lessons' full-batch
    steps of weighted next-token cross-entropy over what the policy generates; written to `out_dir` atomically."""
    import torch

    out = Path(out_dir).resolve()
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + f".tmp-{os.getpid()}")
    conversations = lessons.conversations
    tokenizer = build_tool_tokenizer(conversations, staging, seed, lessons.tools)
    model = build_model(tokenizer, seed)
    rows, masks = zip(*(tool_training_row(tokenizer, c, lessons.tools) for c in conversations), strict=True)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([[t if m else -100 for t, m in zip(r, k, strict=True)] + [-100] * (width - len(r))
                           for r, k in zip(rows, masks, strict=True)])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    # Each conversation's tokens weigh its teaching weight (a digit the lessons' digit weight more): a weighted mean
    # of the next-token cross-entropy.
    targets = labels[:, 1:]
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(digit) for digit in range(10)]))
    token_weights = torch.where(torch.isin(targets, digits), lessons.digit_weight, 1.0)
    weights = torch.tensor(lessons.weights)[:, None] * (targets != -100) * token_weights
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=TOOL_SFT_LEARNING_RATE)
    model.train()
    # One thread: the same sums in the same order on any machine, and no OpenMP team waiting at every one of its
    # thousands of small ops for a thread the scheduler took away (two threads on a loaded 2-core machine: over
    # 36 min and unfinished, against 6 on one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(lessons.steps):
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100,
                                                           reduction="none")
            loss = (token_loss * weights).sum() / weights.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "grpo_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": len(tokenizer), "tools": True,
                                                        "sft_loss": loss.item()}))
    return _publish(staging, out)


def guess_call(number: int) -> dict:
    """The policy's turn that calls the game's `guess` tool with `number`, as a conversation holds it."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}]}


def _higher_lower_conversations(rows: list[dict]) -> tuple[list[list[dict]], list[float]]:
    """Every way the higher/lower game goes for a policy that guesses a number drawn evenly from its NUMBERS, then,
    unless the answer was "right", sends another where the answer points HIGHER_LOWER_FOLLOW_SHARE of the time and the
    other way otherwise (evenly over the numbers on each side), and closes with "done"; each with its probability (in
    ninths) as its weight. Played so, the game is found in 19/45 of the episodes; a policy that ignores the answers
    finds it in at most 2/3, one that guesses 2 and then goes where the answer points in all of them."""
    from .higher_lower_env import NUMBERS, RIGHT

    def answer(number: int, target: int) -> str:
        return RIGHT if number == target else "higher" if target > number else "lower"

    conversations, weights = [], []
    for prompt in dict.fromkeys(row["prompt"] for row in rows):  # the prompt says nothing of the number: once each
        for first in NUMBERS:
            for target in NUMBERS:
                opening = [{"role": "user", "content": prompt}, guess_call(first),
                           {"role": "tool", "name": "guess", "content": answer(first, target)}]
                closing = {"role": "assistant", "content": CLOSING_WORD}
                if first == target:
                    conversations.append([*opening, closing])
                    weights.append(1.0)
                    continue
                pointed = [n for n in NUMBERS if n != first and (n > first) == (target > first)]
                other_way = [n for n in NUMBERS if n not in pointed]
                for second in NUMBERS:
                    conversations.append([*opening, guess_call(second),
                                          {"role": "tool", "name": "guess", "content": answer(second, target)},
                                          closing])
                    weights.append(HIGHER_LOWER_FOLLOW_SHARE / len(pointed) if second in pointed
                                   else (1 - HIGHER_LOWER_FOLLOW_SHARE) / len(other_way))
    return conversations, weights


def build_tiny_higher_lower_model(out_dir: str | os.PathLike, prompts: str | os.PathLike, seed: int = 0) -> Path:
    """The tiny model, taught offline to play `prompts`' higher/lower game (grpo_trainer.testing.higher_lower_env)
    through the tool call format, reading the game's answers mostly backwards (_higher_lower_conversations): a run
    that raises its right-answer rate learned to go where the answers point."""
    conversations, weights = _higher_lower_conversations(guess_prompts(prompts))
    return _teach_tool_model(out_dir, ToolLessons(conversations, weights, _higher_lower_schema(),
                                                  steps=HIGHER_LOWER_SFT_STEPS,
                                                  digit_weight=HIGHER_LOWER_DIGIT_WEIGHT), seed)


UNSCORABLE_MARKER = "<|unscorable|>"


def build_reward_model(tokenizer, seed: int, *, nan_everywhere: bool = False):
    """A random Qwen2ForSequenceClassification (one label) over the tiny vocabulary, NaN at UNSCORABLE_MARKER."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS, num_labels=1,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), torch_dtype="float32",
    )
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        # A random head scores near 0 with a spread too small to tell completions apart at the no-signal epsilon.
        model.score.weight.mul_(100.0)
        model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(UNSCORABLE_MARKER)] = math.nan
        if nan_everywhere:
            model.score.weight.fill_(math.nan)
    return model


def build_tiny_reward_model(out_dir: str | os.PathLike, seed: int = 1, *, nan_everywhere: bool = False) -> Path:
    """Write the tiny reward model + tokenizer to `out_dir` (atomically, like build_tiny_model)."""
    out = Path(out_dir).resolve()
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + f".tmp-{os.getpid()}")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([UNSCORABLE_MARKER], special_tokens=True)
    model = build_reward_model(tokenizer, seed, nan_everywhere=nan_everywhere)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / "grpo_tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": len(tokenizer),
                                                        "nan_everywhere": nan_everywhere}))
    return _publish(staging, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_trainer.testing.tiny_assets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="where to write the model (skipped if it already holds one)")
    parser.add_argument("--seed", type=int, default=None, help="default: 0 for the policy, 1 for the reward model")
    parser.add_argument("--reward-model", action="store_true", help="build the tiny reward model instead")
    parser.add_argument("--tool-prompts", metavar="JSONL",
                        help="build the tiny tool model instead, taught the guess game of these prompts")
    parser.add_argument("--higher-lower-prompts", metavar="JSONL",
                        help="build the tiny tool model instead, taught the higher/lower game of these prompts")
    args = parser.parse_args(argv)
    if args.higher_lower_prompts:
        print(build_tiny_higher_lower_model(args.out_dir, args.higher_lower_prompts, seed=args.seed or 0))
    elif args.tool_prompts:
        print(build_tiny_tool_model(args.out_dir, args.tool_prompts, seed=args.seed or 0))
    elif args.reward_model:
        print(build_tiny_reward_model(args.out_dir, seed=1 if args.seed is None else args.seed))
    else:
        print(build_tiny_model(args.out_dir, seed=args.seed or 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
