"""Short plain-English stories from a small grammar: the quickstart's default corpus.

Python's documentation prose (`corpus.py`) is technical text with a long tail of words: in the
quickstart's budget (~3 minutes of one CPU core) a tiny model learns only its word frequencies there
(held-out ELBO about 17% below the start, samples like "the the a,.,"). These stories use ~300
everyday words in regular sentences (subject, verb, object, place, time; number agreement, a tense per
story, verbs that take fitting objects), so the same budget shows a model learning to use context.

`simple_stories(n, seed)` is deterministic (Python's `random.Random`), needs no file or network, and
draws from ~10^12 sentences: held-out stories drawn with another seed are new text, not copies.
"""

from __future__ import annotations

import random

# noun: (singular, plural)
PEOPLE = [("man", "men"), ("woman", "women"), ("boy", "boys"), ("girl", "girls"), ("teacher", "teachers"),
          ("farmer", "farmers"), ("doctor", "doctors"), ("baker", "bakers"), ("sailor", "sailors"),
          ("child", "children"), ("king", "kings"), ("queen", "queens"), ("friend", "friends"),
          ("student", "students"), ("driver", "drivers"), ("painter", "painters"), ("fisherman", "fishermen")]
ANIMALS = [("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"), ("cow", "cows"),
           ("fox", "foxes"), ("rabbit", "rabbits"), ("duck", "ducks"), ("mouse", "mice"), ("goat", "goats")]
THINGS = [("box", "boxes"), ("basket", "baskets"), ("bag", "bags"), ("key", "keys"), ("hat", "hats"),
          ("coat", "coats"), ("cup", "cups"), ("ball", "balls"), ("lamp", "lamps"), ("chair", "chairs"),
          ("bottle", "bottles"), ("ring", "rings"), ("coin", "coins"), ("stone", "stones"), ("bell", "bells")]
TEXTS = [("book", "books"), ("letter", "letters"), ("map", "maps"), ("story", "stories"), ("note", "notes")]
FOODS = [("apple", "apples"), ("cake", "cakes"), ("egg", "eggs"), ("orange", "oranges"), ("pie", "pies"),
         ("carrot", "carrots"), ("pear", "pears"), ("sandwich", "sandwiches"), ("biscuit", "biscuits"),
         ("plum", "plums")]
PLACES = ["market", "river", "garden", "school", "house", "village", "forest", "church", "station", "shop",
          "hill", "farm", "park", "harbour", "kitchen", "library", "bridge", "field", "beach", "lake"]

ADJECTIVES = {
    "people": ["old", "young", "tall", "little", "kind", "happy", "tired", "clever", "quiet", "busy"],
    "animals": ["little", "big", "brown", "white", "black", "old", "young", "hungry", "small", "lazy"],
    "things": ["red", "blue", "green", "heavy", "small", "big", "old", "new", "wooden", "round"],
    "texts": ["old", "new", "long", "short", "funny", "sad", "small", "thick"],
    "foods": ["fresh", "sweet", "warm", "ripe", "small", "big", "red", "green"],
    "places": ["old", "small", "big", "quiet", "busy", "green", "little", "new"],
}
NOUNS = {"people": PEOPLE, "animals": ANIMALS, "things": THINGS, "texts": TEXTS, "foods": FOODS}

# verb: (present singular, present plural, past), the subject kinds and the object kinds it takes
TRANSITIVE = [
    (("carries", "carry", "carried"), ("people",), ("things", "foods", "texts")),
    (("finds", "find", "found"), ("people", "animals"), ("things", "foods")),
    (("loses", "lose", "lost"), ("people",), ("things", "texts")),
    (("buys", "buy", "bought"), ("people",), ("things", "foods", "texts")),
    (("sells", "sell", "sold"), ("people",), ("things", "foods")),
    (("brings", "bring", "brought"), ("people",), ("things", "foods", "texts")),
    (("drops", "drop", "dropped"), ("people",), ("things", "foods")),
    (("opens", "open", "opened"), ("people",), ("things", "texts")),
    (("eats", "eat", "ate"), ("people", "animals"), ("foods",)),
    (("cooks", "cook", "cooked"), ("people",), ("foods",)),
    (("reads", "read", "read"), ("people",), ("texts",)),
    (("writes", "write", "wrote"), ("people",), ("texts",)),
    (("sees", "see", "saw"), ("people", "animals"), ("people", "animals", "things")),
    (("meets", "meet", "met"), ("people",), ("people",)),
    (("helps", "help", "helped"), ("people",), ("people",)),
    (("watches", "watch", "watched"), ("people", "animals"), ("people", "animals")),
    (("feeds", "feed", "fed"), ("people",), ("animals",)),
    (("chases", "chase", "chased"), ("animals",), ("animals", "people")),
    (("follows", "follow", "followed"), ("people", "animals"), ("people", "animals")),
]
GIVING = [("gives", "give", "gave"), ("shows", "show", "showed"), ("sends", "send", "sent")]
MOTION = [("walks", "walk", "walked"), ("runs", "run", "ran"), ("goes", "go", "went"), ("hurries", "hurry", "hurried")]
STAYING = [("sleeps", "sleep", "slept"), ("sits", "sit", "sat"), ("plays", "play", "played"),
           ("waits", "wait", "waited"), ("sings", "sing", "sang")]
BE = {("present", False): "is", ("present", True): "are", ("past", False): "was", ("past", True): "were"}
STATES = ["happy", "tired", "hungry", "busy", "ready", "late", "cold", "sad", "glad", "quiet"]
MANNER = ["slowly", "quickly", "quietly", "happily", "together"]
AT_PLACE = ["in", "near", "by", "behind"]
TIMES = {"present": ["in the morning", "in the evening", "at night", "every day", "on sunday", "after school",
                     "every morning", "today"],
         "past": ["in the morning", "in the evening", "at night", "on sunday", "after school", "yesterday",
                  "last week", "one day"]}
PRONOUNS = {"people": [("he", False), ("she", False), ("they", True)], "animals": [("it", False), ("they", True)]}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Story:
    """One story: a tense, a cast (its first subject, referred to again by a pronoun) and sentences."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.tense = "past" if rng.random() < 0.6 else "present"
        self.hero_kind = "people" if rng.random() < 0.75 else "animals"
        self.hero_plural = rng.random() < 0.3
        self.hero = rng.choice(NOUNS[self.hero_kind])
        self.hero_adjective = rng.choice(ADJECTIVES[self.hero_kind])
        self.told = 0

    def noun_phrase(self, kind: str, definite: bool | None = None, plural: bool | None = None) -> tuple[str, bool]:
        rng = self.rng
        plural = rng.random() < 0.3 if plural is None else plural
        noun = rng.choice(NOUNS[kind])[plural]
        words = [rng.choice(ADJECTIVES[kind]), noun] if rng.random() < 0.45 else [noun]
        if definite if definite is not None else rng.random() < 0.55:
            determiner = "the"
        elif plural:
            determiner = rng.choice(["some", "two", "three", "many"])
        else:
            determiner = _article(words[0])
        return " ".join([determiner, *words]), plural

    def place(self) -> str:
        adjective = self.rng.choice(ADJECTIVES["places"]) + " " if self.rng.random() < 0.3 else ""
        return f"the {adjective}{self.rng.choice(PLACES)}"

    def subject(self, kinds: tuple[str, ...]) -> tuple[str, bool, str]:
        """(words, plural, kind): the story's hero (named in full first, then often by a pronoun) or another."""
        rng = self.rng
        if self.hero_kind in kinds and (self.told == 0 or rng.random() < 0.6):
            self.told += 1
            if self.told > 1 and rng.random() < 0.6:
                pronouns = [p for p in PRONOUNS[self.hero_kind] if p[1] == self.hero_plural]
                return rng.choice(pronouns)[0], self.hero_plural, self.hero_kind
            noun = self.hero[self.hero_plural]
            return f"the {noun if self.told > 1 else self.hero_adjective + ' ' + noun}", self.hero_plural, self.hero_kind
        kind = rng.choice(kinds)
        words, plural = self.noun_phrase(kind, definite=True)
        return words, plural, kind

    def verb(self, forms: tuple[str, str, str], plural: bool) -> str:
        return forms[2] if self.tense == "past" else forms[1] if plural else forms[0]

    def time(self) -> str:
        return self.rng.choice(TIMES[self.tense])

    def sentence(self) -> str:
        rng = self.rng
        form = rng.random()
        leading_time = rng.random() < 0.15
        if form < 0.45:  # subject verb object [place] [time]
            forms, subjects, objects = rng.choice(TRANSITIVE)
            subject, plural, _ = self.subject(subjects)
            obj, _ = self.noun_phrase(rng.choice(objects))
            words = [subject, self.verb(forms, plural), obj]
            if rng.random() < 0.3:
                words += [rng.choice(AT_PLACE), self.place()]
            if rng.random() < 0.3 and rng.random() < 0.5:  # a second verb phrase on the same subject
                forms, _, objects = rng.choice([v for v in TRANSITIVE if set(v[1]) >= {"people"}])
                words += ["and", self.verb(forms, plural), self.noun_phrase(rng.choice(objects))[0]]
        elif form < 0.6:  # subject gave person thing
            subject, plural, _ = self.subject(("people",))
            words = [subject, self.verb(rng.choice(GIVING), plural), self.noun_phrase("people", definite=True)[0],
                     self.noun_phrase(rng.choice(["things", "foods", "texts"]))[0]]
        elif form < 0.8:  # subject moved / stayed [manner] place
            subject, plural, _ = self.subject(("people", "animals"))
            if rng.random() < 0.5:
                words = [subject, self.verb(rng.choice(MOTION), plural)]
                words += [rng.choice(MANNER)] if rng.random() < 0.3 else []
                words += ["to", self.place()]
            else:
                words = [subject, self.verb(rng.choice(STAYING), plural)]
                words += [rng.choice(MANNER)] if rng.random() < 0.3 else []
                words += [rng.choice(AT_PLACE), self.place()]
        elif form < 0.9:  # subject was state [because ...]
            subject, plural, kind = self.subject(("people", "animals"))
            words = [subject, BE[self.tense, plural], rng.choice(STATES)]
        else:  # there was a thing / animal at a place
            noun_phrase, plural = self.noun_phrase(rng.choice(["animals", "things", "foods"]), definite=False)
            words = ["there", BE[self.tense, plural], noun_phrase, rng.choice(AT_PLACE), self.place()]
        if leading_time:
            text = f"{self.time()}, " + " ".join(words)
        else:
            text = " ".join(words + ([self.time()] if rng.random() < 0.25 else []))
        return text[0].upper() + text[1:] + "."


def simple_stories(n: int, seed: int = 0, min_sentences: int = 3, max_sentences: int = 6) -> list[str]:
    """`n` stories of `min_sentences`..`max_sentences` sentences each, deterministic in `seed`."""
    rng = random.Random(seed)
    stories = []
    for _ in range(n):
        story = _Story(rng)
        stories.append(" ".join(story.sentence() for _ in range(rng.randint(min_sentences, max_sentences))))
    return stories


def stories_corpus(vocab_size: int = 1024, train_stories: int = 6000, heldout_stories: int = 150) -> dict:
    """The quickstart corpus: `train_stories` stories (seed 0) and `heldout_stories` others (seed 1), a
    word-level tokenizer of the train part (every word of the grammar fits in 1024) and both parts' ids.
    Builds in about a second, so nothing is cached. Same keys as `corpus.cached_prose_corpus`."""
    from .corpus import CHAT_TEMPLATE, corpus_words, train_word_tokenizer

    train, heldout = simple_stories(train_stories, seed=0), simple_stories(heldout_stories, seed=1)
    # the chat template's role words too, so a chat prompt has no unknown tokens
    tokenizer = train_word_tokenizer(train + ["System: User: Assistant:"], vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    words = {w for story in train for w in corpus_words(story)}
    return {"tokenizer": tokenizer, "train_ids": encode(train), "heldout_ids": encode(heldout), "words": words,
            "cached": False, "source": f"short stories from a {len(words)}-word grammar (built)"}
