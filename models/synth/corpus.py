"""A small built-in corpus for training the synthetic BPE tokenizers.

Plain prose, chat-shaped lines, code, numbers and a little non-English text, so the learned
merges look like a language model's (common words, indentation, digits) while staying a few KB.
Written for this project; changing it changes every trained vocabulary.
"""

from __future__ import annotations

_PROSE = """\
The engine runs one step at a time. Each step takes the requests that are waiting, gives every
running request one more token, and returns what changed. A request that finished leaves the
batch, and its pages go back to the pool. When memory is short, the scheduler waits instead of
guessing; when a prompt is long, it is split into chunks so that decoding never stalls.
Small models are fast to test and slow to fool. A test that passes on random weights tells you
the plumbing is right: the shapes line up, the cache holds what it should, and the numbers agree
with a reference written in plain code. A test on a real checkpoint tells you the model is right.
It was a quiet morning in the city. The river was high after the rain, and the bridges were full
of people walking to work. Somebody was selling coffee at the corner, somebody else was reading
the news, and the trains came and went every few minutes, as they always do.
What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week.
Please write a short poem about the sea. The sea is wide, the sea is deep, it sings the sailors
off to sleep.
Explain why the sky is blue. Sunlight is scattered by the air, and blue light is scattered more
than red light, so the sky looks blue from every direction.
Thank you for your help! You are welcome. Let me know if there is anything else I can do.
"""

_CODE = """\
def attention(query, key, value, scale):
    scores = query @ key.transpose(-1, -2) * scale
    weights = scores.softmax(dim=-1)
    return weights @ value


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.free = list(range(1, num_pages))

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError(f"need {count} pages, have {len(self.free)}")
        pages, self.free = self.free[:count], self.free[count:]
        return pages


for index, token in enumerate(tokens):
    if token == eos_token_id:
        break
    print(index, token)

{"model": "qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
"""

_NUMBERS = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 16 24 32 48 64 100 128 256 512 1000 1024 2048 4096 65536
3.14159 2.71828 1e-06 0.25 0.5 1.0 -1 +1 42 2026-01-01 12:30:45 #1 50% $10 x = y + z * 2
"""

_OTHER = """\
Bonjour, comment allez-vous ? Très bien, merci. Guten Tag! Wie geht es Ihnen? Gut, danke.
¿Dónde está la estación? Está cerca del río. Привет, как дела? Хорошо, спасибо.
你好，今天天气很好。我们去公园散步吧。こんにちは、元気ですか。안녕하세요, 반갑습니다.
"""

CORPUS: tuple[str, ...] = (_PROSE, _CODE, _NUMBERS, _OTHER)
