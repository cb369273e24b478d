"""A tiny byte-level BPE tokenizer, trained in milliseconds, for tests without downloads."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today?",
    "I am fine, thank you. What about you?",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "She loved to read books about science, history, and the stars at night.",
    "Machine learning models predict the next token given the previous tokens.",
    "A language model assigns a probability to every sequence of words.",
    "Large language models are served by inference engines on GPUs.",
    "The scheduler batches requests together to keep the accelerator busy.",
    "Paged attention stores the key and value cache in fixed-size blocks.",
    "Prefix caching lets requests that share a prompt reuse the same cache pages.",
    "Please write a short poem about the sea and the wind.",
    "The sea is wide, the wind is free, the waves are singing songs to me.",
    "What is two plus two? Two plus two is four.",
    "Numbers like 0, 1, 2, 3, 42, 100 and 2024 appear in text too.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(4, 8)\n",
    "Tokenizers split text into pieces called tokens; each token has an id.",
    "Sampling with a temperature makes the output more or less random.",
    "Top-k and top-p sampling restrict the choice to the most likely tokens.",
    "The same seed should always give the same answer.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Good morning! Good evening! Good night!",
    "They said: \"We will meet again tomorrow at noon.\"",
    "Water boils at 100 degrees Celsius at sea level.",
    "The mitochondria is the powerhouse of the cell.",
    "User: Can you help me? Assistant: Of course, I can help you.",
    "Streaming output sends each new piece of text as soon as it is ready.",
    "Stop strings end the generation when they appear in the output.",
    "Email me at someone@example.com or visit https://example.com/docs.",
    "你好，世界！今天天气很好。",
    "我喜欢学习机器学习和自然语言处理。",
    "北京是中国的首都。",
    "こんにちは、元気ですか？",
    "Emoji are fun 😀 🎉 🚀 ❤️ 👍",
    "The rocket 🚀 flew to the moon 🌕 and back.",
)


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def build_tiny_tokenizer(output_dir: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a deterministic tiny byte-level BPE tokenizer, save it to `output_dir`, return it.

    Any text (including CJK and emoji) can be encoded since all 256 bytes are in the alphabet.
    Special tokens: `<|endoftext|>` (id 0; eos and pad), `<|im_start|>`, `<|im_end|>`. It carries
    a ChatML chat template and loads back with `AutoTokenizer.from_pretrained(output_dir)`.
    """
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size}, got {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train(vocab_size),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(output_dir))
    return tokenizer
