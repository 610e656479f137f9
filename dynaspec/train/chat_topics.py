"""General chat prompts for a draft head's corpus, made here and kept apart from the bench's.

The bench's chat workload asks everyday questions (bench/workloads.py CHAT_QUESTIONS). A head
trained only on Python questions drafted those answers badly (held-out position-1 acceptance
0.20 against 0.32 on code edits), so the target also answers everyday prompts built from the
templates and subjects below. No subject shares a content word with a bench question
(`overlapping_subjects` is empty, tested), so the bench's chat prompts stay held out.
"""

from __future__ import annotations

import random
import re

from dynaspec.bench.workloads import CHAT_QUESTIONS

# {s}: a subject; {n}: a small count.
TEMPLATES = (
    "Explain {s} to a beginner.",
    "What is {s}? Answer in a few sentences.",
    "Give me {n} tips about {s}.",
    "What are the pros and cons of {s}?",
    "Write a short paragraph about {s}.",
    "How does {s} work?",
    "What are common misconceptions about {s}?",
    "Write a short poem about {s}.",
    "Describe {s} to a ten-year-old.",
    "Why does {s} matter? Give a short answer.",
    "List {n} interesting facts about {s}.",
    "What questions should I ask before starting with {s}?",
    "Summarise the history of {s} in a few sentences.",
    "Write a friendly message to a colleague about {s}.",
    "What is a good first step for someone interested in {s}?",
    "Give a short example that illustrates {s}.",
)

SUBJECTS = (
    "gravity", "magnetism", "volcanoes", "earthquakes", "tides", "rainbows",
    "the moon's phases", "evolution by natural selection", "DNA", "coral reefs", "bees",
    "migrating birds", "glaciers", "deserts", "rainforests", "the human heart", "bacteria",
    "solar panels", "wind turbines", "nuclear fusion", "comets", "the planet Mars", "dinosaurs",
    "fossils", "ocean currents", "thunderstorms", "snowflakes", "octopuses", "mushrooms",
    "the food chain", "microscopes", "telescopes", "probability", "prime numbers", "fractions",
    "statistics", "geometry", "algebra", "logarithms", "databases", "encryption", "passwords",
    "cloud computing", "version control with git", "unit testing", "open source software",
    "compilers", "web browsers", "search engines", "spreadsheets", "binary numbers",
    "sorting algorithms", "linked lists", "caching", "computer networks", "smartphones",
    "robots", "virtual reality", "code review", "technical debt", "agile development",
    "debugging", "regular expressions", "the command line", "backups", "wifi routers",
    "stretching", "running a first marathon", "meditation", "healthy breakfasts",
    "reducing screen time", "keeping houseplants alive", "saving money on groceries",
    "budgeting", "a first apartment", "moving to a new city", "decluttering a closet",
    "procrastination", "making new friends", "public speaking", "giving feedback",
    "negotiating a salary", "taking notes", "memorising vocabulary", "reading more books",
    "journaling", "gardening", "birdwatching", "making pancakes", "brewing coffee",
    "tea ceremonies", "pizza dough", "fermented foods", "vegetarian cooking", "spices",
    "knife skills", "meal planning", "cleaning a kitchen", "painting a room",
    "fixing a leaky faucet", "caring for a dog", "adopting a cat", "keeping chickens",
    "aquariums", "the Roman Empire", "ancient Egypt", "the Silk Road", "the Renaissance",
    "the Industrial Revolution", "democracy", "taxes", "libraries", "museums", "jazz music",
    "classical music", "film making", "theatre", "poetry", "comic books", "board games",
    "the Olympic Games", "football", "tennis", "origami", "volunteering", "recycling",
    "public transport", "city planning", "airplanes", "sailing", "mountain climbing",
    "camping in winter", "maps", "time zones", "calendars", "money", "banks", "insurance",
    "startups", "marketing", "customer service", "leadership", "ethics", "philosophy",
    "happiness", "curiosity", "chemical elements", "the brain", "sound waves", "static charge",
    "climate models", "measuring units", "Linux", "phishing", "pottery", "hydration",
    "bicycles", "deadlines", "job applications", "studying at a library", "kayaking",
    "piano lessons", "oil painting", "knitting", "windmills", "tramways",
    "bridges", "medieval fortresses",
)  # fmt: skip

_STOP = {"what", "when", "where", "which", "while", "there", "their", "about", "with", "from",
         "into", "that", "this", "your", "does", "have", "give", "short", "write", "explain",
         "simple", "example", "plain", "words", "using", "three", "sentences", "between"}


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in _STOP}


def overlapping_subjects() -> list[str]:
    """Subjects sharing a content word (4+ letters, stems compared on their first 5) with a
    bench chat question: must stay empty."""
    held = {w[:5] for q in CHAT_QUESTIONS for w in _words(q)}
    return [s for s in SUBJECTS if any(w[:5] in held for w in _words(s))]


def everyday_prompt(rng: random.Random) -> str:
    return rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), n=rng.choice((3, 4, 5)))
