"""A small corpus of generated children's stories, in the style of TinyStories.

The spec's examples continue "a TinyStories decoder". Nothing may download here, so the project
generates its own stand-in: short stories assembled from templates and word lists, repeatable
from a seed. The vocabulary is a few hundred words and the sentence patterns are few, so a decoder
with a couple of layers learns the corpus in about a minute on a CPU, yet the slots vary enough
that the model has real choices to make.

Stories about a dog are a deliberate minority. The GRPO example samples eight tokens after
``"Once upon a time, there was a little"`` and rewards completions that mention "dog"; in this
corpus roughly one such continuation in ten does (:func:`dog_rate` measures it), so the reward is
neither hopeless nor already saturated before reinforcement learning starts.

Example:
    >>> from dew_pipe.data.stories import generate_stories
    >>> stories = generate_stories(3, seed=0)
    >>> len(stories)
    3
    >>> all(story.endswith(".") or story.endswith('"') for story in stories)
    True
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["DOG_PROMPT", "dog_rate", "generate_stories", "story_tokenizer"]

#: The prompt of the spec's GRPO example; most stories open with it.
DOG_PROMPT = "Once upon a time, there was a little"

# Who a story is about: (word, pronoun or None to pick one). The weights set the share of
# stories whose hero is a dog (about 6%); "had a dog" in the next sentence adds about 3% more.
_HEROES: tuple[tuple[str, str | None, float], ...] = (
    ("girl", "She", 20.0),
    ("boy", "He", 20.0),
    ("cat", None, 10.0),
    ("bird", None, 8.0),
    ("bunny", None, 8.0),
    ("bear", None, 7.0),
    ("fox", None, 6.0),
    ("duck", None, 6.0),
    ("mouse", None, 5.0),
    ("dog", None, 6.0),
    ("frog", None, 4.0),
)
_NAMES = {
    "She": ("Lily", "Mia", "Lucy", "Anna", "Sue", "Emma", "Zoe", "Amy", "Rosa", "Ivy"),
    "He": ("Tom", "Ben", "Sam", "Max", "Tim", "Jack", "Leo", "Bob", "Finn", "Dan"),
}
_PETS = (("cat", 10.0), ("fish", 8.0), ("bird", 6.0), ("toy car", 6.0), ("dog", 3.0))
_PLACES = (  # (where to go, where something is)
    ("park", "in the park"), ("garden", "in the garden"), ("forest", "in the forest"),
    ("beach", "at the beach"), ("farm", "on the farm"), ("pond", "by the pond"),
    ("hill", "on the hill"), ("market", "at the market"), ("river", "near the river"),
)  # fmt: skip
_TOWNS = ("town", "village", "house", "wood", "city")
_SMALL = ("small", "quiet", "sunny", "busy", "green")
_LIKES = (
    "play with a red ball", "run in the grass", "sing happy songs", "jump in puddles",
    "look at the stars", "pick pretty flowers", "build tall towers", "draw big pictures",
    "eat sweet apples", "splash in the water", "climb little trees", "read funny books",
)  # fmt: skip
_THINGS = (
    "ball", "box", "kite", "hat", "cake", "stone", "shell", "key", "boat", "drum", "cup", "flower",
)  # fmt: skip
_COLOURS = ("red", "blue", "yellow", "green", "shiny", "big", "tiny", "soft", "old", "pink")
_PROBLEMS = (
    "it was too high", "it was stuck in a tree", "it was very heavy", "it fell in the pond",
    "the wind took it away", "it was under a big rock", "a bird sat on it", "it was broken",
)  # fmt: skip
_HELPERS = ("mom", "dad", "friend", "sister", "brother", "grandma", "teacher")
_FEELINGS = ("happy", "sad", "brave", "kind", "proud", "tired", "excited", "scared")
_SAYINGS = (
    "Let us try together!", "Do not give up!", "I can help you!", "We can share it!",
    "Be careful!", "What a great day!", "Thank you, friend!", "You are so kind!",
)  # fmt: skip
_ENDINGS = (
    "From that day on, {name} was always {feeling}.",
    "They played together until the sun went down.",
    "{name} went home and had a good sleep.",
    "{name} learned that sharing makes everyone {feeling}.",
    "Everyone smiled, and {name} felt {feeling}.",
    "The end.",
)


@dataclass(frozen=True)
class _Hero:
    kind: str
    name: str
    pronoun: str


def _hero(rng: random.Random) -> _Hero:
    kinds, pronouns, weights = zip(*_HEROES, strict=True)
    index = rng.choices(range(len(kinds)), weights=weights)[0]
    pronoun = pronouns[index] or rng.choice(("He", "She"))
    return _Hero(kinds[index], rng.choice(_NAMES[pronoun]), pronoun)


def _opening(rng: random.Random, hero: _Hero) -> str:
    roll = rng.random()
    if roll < 0.6:
        return f"{DOG_PROMPT} {hero.kind} named {hero.name}."
    if roll < 0.8:
        return (
            f"One day, a little {hero.kind} named {hero.name} went to the {rng.choice(_PLACES)[0]}."
        )
    return (
        f"Once upon a time, in a {rng.choice(_SMALL)} {rng.choice(_TOWNS)}, "
        f"there lived a {hero.kind} named {hero.name}."
    )


def _second(rng: random.Random, hero: _Hero) -> str:
    if rng.random() < 0.3:
        pets, weights = zip(*_PETS, strict=True)
        pet = rng.choices(pets, weights=weights)[0]
        return f"{hero.pronoun} had a {pet}."
    return f"{hero.pronoun} liked to {rng.choice(_LIKES)}."


def _middle(rng: random.Random, hero: _Hero) -> list[str]:
    thing = rng.choice(_THINGS)
    colour = rng.choice(_COLOURS)
    helper = rng.choice(_HELPERS)
    lines = [
        f"One day, {hero.name} saw a {colour} {thing} {rng.choice(_PLACES)[1]}.",
        f"{hero.pronoun} wanted to get the {thing}, but {rng.choice(_PROBLEMS)}.",
    ]
    if rng.random() < 0.5:
        lines.append(f'{hero.name} felt {rng.choice(_FEELINGS)}. "{rng.choice(_SAYINGS)}"')
    possessive = "his" if hero.pronoun == "He" else "her"
    lines.append(f"{hero.pronoun} asked {possessive} {helper} for help.")
    lines.append(f'The {helper} said, "{rng.choice(_SAYINGS)}"')
    lines.append(f"Together they got the {colour} {thing}.")
    if rng.random() < 0.3:
        lines.append(f"{hero.pronoun} kicked it to {possessive} {helper}.")
    return lines


def generate_stories(count: int = 3000, *, seed: int = 0) -> list[str]:
    """Generate ``count`` short stories, the same ones for the same ``seed``.

    Args:
        count: number of stories (at least 1).
        seed: seed of the generator; uses Python's ``random.Random``, whose sequence is stable
            across Python versions for the calls made here.

    Returns:
        A list of ``count`` strings, each a story of six to nine sentences (about 60 to 90 words).

    Raises:
        ValueError: if ``count`` is below 1.
        TypeError: if ``count`` or ``seed`` is not an integer.

    Example:
        >>> generate_stories(1, seed=3) == generate_stories(1, seed=3)
        True
    """
    for field, value in (("count", count), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    rng = random.Random(seed)
    stories = []
    for _ in range(count):
        hero = _hero(rng)
        sentences = [_opening(rng, hero), _second(rng, hero), *_middle(rng, hero)]
        ending = rng.choice(_ENDINGS).format(name=hero.name, feeling=rng.choice(_FEELINGS))
        sentences.append(ending)
        stories.append(" ".join(sentences))
    return stories


def dog_rate(stories: Sequence[str], *, words: int = 7, prompt: str = DOG_PROMPT) -> float:
    """Share of the stories opening with ``prompt`` whose next ``words`` words mention "dog".

    This is the corpus-level chance that the GRPO example's reward fires on a continuation
    sampled from a model that learned the corpus perfectly: with the project's tokenizer, eight
    tokens after the prompt cover about seven words and their punctuation.

    Args:
        stories: the stories to measure.
        words: how many whitespace-separated words after the prompt to look at.
        prompt: the opening to condition on.

    Returns:
        A fraction in [0, 1].

    Raises:
        ValueError: if no story opens with ``prompt``.

    Example:
        >>> 0.05 <= dog_rate(generate_stories(2000)) <= 0.15
        True
    """
    continuations = [s[len(prompt) :].split()[:words] for s in stories if s.startswith(prompt)]
    if not continuations:
        raise ValueError(f"prompt {prompt!r}: no story opens with it; expected at least one")
    hits = sum(any(w.strip('.,!?"').lower() == "dog" for w in ws) for ws in continuations)
    return hits / len(continuations)


def story_tokenizer(
    directory: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int = 1024,
    count: int = 3000,
    seed: int = 0,
) -> PreTrainedTokenizerFast:
    """Train the project's small byte-level BPE tokenizer on the generated stories.

    The training text is the story corpus plus a few chat-formatted lines, so role names and
    tool-call markup get tokens of their own. See :func:`dew_pipe.data.tokenizer.build_tokenizer`.

    Args:
        directory: where to ``save_pretrained`` the tokenizer (``AutoTokenizer.from_pretrained``
            reloads it); None keeps it in memory only.
        vocab_size: size of the BPE vocabulary, special tokens included.
        count: number of stories to train on.
        seed: seed of :func:`generate_stories`.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the project's chat template.

    Example:
        >>> tokenizer = story_tokenizer(vocab_size=512, count=200)
        >>> tokenizer.decode(tokenizer.encode(DOG_PROMPT)) == DOG_PROMPT
        True
    """
    from dew_pipe.data.tokenizer import build_tokenizer, chat_samples

    texts = generate_stories(count, seed=seed) + chat_samples()
    return build_tokenizer(texts, vocab_size=vocab_size, directory=directory)
