#!/usr/bin/env python
"""Build the distillation data for the SmolLM2 draft model (see models/draft/README.md).

All outputs go under ``~/.cache/sequoia-kernels/draft-data/`` (``--data-dir``), never the repo.

Subcommands (run them nice'd: ``nice -n 19 python scripts/draft/draft_data.py ...``; every heavy
step uses one thread):

``corpus``    (light, ~5 minutes) Collect offline text -- CPython's standard library
              sources, Debian ``python3.11-doc`` reStructuredText, man pages -- tokenize it
              (``add_special_tokens=False``) into ``corpus/<source>.tokens.npy`` (uint16) +
              ``.offsets.npy``, and write the training prompt list ``prompts-train.jsonl``
              (chat instructions built from the corpus + general topics, and raw
              continuation prompts cut from the corpus). Copies the held-out prompts.
``prompts``   Only rebuild ``prompts-train.jsonl`` from the texts saved by ``corpus``.
``generate``  (heavy) The target answers/continues training prompts (temperature 0.7 mostly,
              some greedy and 1.0), batched with a KV cache. Its full-vocab logits are free at
              every position (prompt and generated), so each shard stores the tokens *and*
              the teacher's top-K logits + logsumexp per position: ``gen/shard-NNNNN.npz``.
``label``     (heavy) Teacher-forced target top-K on 256-token corpus windows:
              ``lab/shard-NNNNN.npz``.
``vocab``     Pick the draft vocabulary: the V target tokens with the most teacher
              probability mass over all labelled positions (generated text weighted x3) ->
              ``vocab-<V>.npy`` + coverage stats.

Shards are written atomically and numbered; a shard's content depends only on its index and
``--seed`` (one thread => deterministic), so interrupted runs resume with ``--until N``.

Shard arrays (N = tokens in the shard, K = top-k):
    tokens [N] uint16, offsets [S+1] int64 (sequence boundaries), topk_ids [N, K] uint16,
    topk_logits [N, K] float16, lse [N] float32 (logsumexp of the full fp32 logits),
    meta: JSON string (one dict per sequence).
Row t of a sequence holds the teacher's distribution for the token *after* token t.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python_api"))

from sequoia_decoding.modeling.smollm2 import CACHE_ROOT, encode, load_target  # noqa: E402
from sequoia_decoding.prompts import prompt_ids, read_prompts  # noqa: E402

DATA_DIR = CACHE_ROOT / "draft-data"
HELDOUT_REPO = REPO / "models" / "draft" / "heldout_prompts.txt"
TOPK = 32
EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|>
PAD_ID = 2


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def atomic_save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")  # per process: two may write the same file
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------

SKIP_STDLIB_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                    "ensurepip", "config-3.11-x86_64-linux-gnu", "lib2to3"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_STDLIB_DIRS and not d.startswith("test"))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_")]
    return out


def stdlib_items(files: list[Path]):
    """Yield (module, qualname, first docstring sentence, source) for documented defs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in files:
        mod = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        stack = [(n, "") for n in tree.body]
        while stack:
            node, prefix = stack.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = prefix + node.name
                if isinstance(node, ast.ClassDef):
                    stack += [(n, qual + ".") for n in node.body]
                if node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                seg = ast.get_source_segment(src, node) or ""
                if doc and 40 <= len(seg) <= 1500:
                    first = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0]
                    yield mod, qual, first, seg


def rst_files() -> list[Path]:
    root = Path("/usr/share/doc/python3.11/html/_sources")
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is missing: install Debian's Python docs with\n"
            "    apt-get update && apt-get install -y python3.11-doc")
    return sorted(p for p in root.rglob("*.txt") if p.is_file())


def man_files(rng: random.Random, max_pages: int) -> list[Path]:
    """English man pages of sections 1,3,5,7,8, deduplicated, gcloud pages skipped, sampled."""
    root = Path("/usr/share/man")
    seen, files = set(), []
    for sec in ("man1", "man3", "man5", "man7", "man8"):
        for p in sorted((root / sec).glob("*")):
            if p.name.startswith("gcloud") or not p.is_file():
                continue
            real = p.resolve()
            if real in seen:
                continue
            seen.add(real)
            files.append(p)
    rng.shuffle(files)
    return sorted(files[:max_pages])


def render_man(path: Path) -> str:
    env = dict(os.environ, MANWIDTH="100", LC_ALL="C.UTF-8")
    env.pop("MAN_KEEP_FORMATTING", None)
    try:
        r = subprocess.run(["man", "--nh", "--nj", "-P", "cat", "-l", str(path)], env=env,
                           capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return ""
    text = r.stdout.decode("utf-8", "replace")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_text_file(p: Path) -> str:
    data = p.read_bytes()
    if p.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


GENERAL_TOPICS = """photosynthesis|the water cycle|black holes|the French Revolution|volcanoes|the immune system|
climate change|the printing press|machine learning|the stock market|honeybees|the Roman Empire|plate tectonics|
vaccines|renewable energy|the human heart|the moon landing|ancient Egypt|electric cars|the internet|coral reefs|
inflation|the Great Wall of China|DNA|rainbows|earthquakes|the Olympic Games|coffee|chess|jazz music|
the solar system|recycling|sleep|meditation|time zones|the Renaissance|airplanes|bread baking|tea ceremonies|
penguins|the Amazon rainforest|democracy|supply and demand|gravity|magnetism|the periodic table|antibiotics|
the Industrial Revolution|glaciers|tides|volunteering|public libraries|bicycles|gardening|composting|
the history of mathematics|prime numbers|the Pythagorean theorem|probability|compound interest|budgeting|
learning a new language|public speaking|job interviews|remote work|healthy breakfasts|running a marathon|
camping|first aid|saving water at home|the Eiffel Tower|the Nile river|Mount Everest|the Sahara desert|
octopuses|dinosaurs|wolves|whales|butterflies|the speed of light|electricity|batteries|solar panels|
wind turbines|3D printing|smartphones|cloud computing|databases|encryption|passwords|open source software|
version control|the Linux kernel|compilers|operating systems|computer networks|web browsers|email|
spreadsheets|robots|self-driving cars|space telescopes|Mars|comets|the northern lights|thunderstorms|
hurricanes|snowflakes|the ocean floor|fossils|cheese making|fermentation|chocolate|pizza|rice cultivation|
urban planning|trains|bridges|skyscrapers|castles|museums|photography|painting|poetry|novels|theatre|
origami|knitting|pottery|birdwatching|astronomy for beginners|the scientific method|critical thinking|
friendship|kindness|time management|procrastination|habits|teamwork|leadership|negotiation|
customer service|small businesses|marketing|taxes|insurance|renting an apartment|moving to a new city""".replace("\n", "")

GENERAL_TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.", "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.", "What are the pros and cons of {t}?",
    "Write a brief history of {t}.", "Why is {t} important?", "Write a haiku about {t}.",
    "Give me a short list of tips related to {t}.", "Write a two-sentence summary of {t}.",
    "Create a quiz question about {t} and answer it.", "Describe {t} in one paragraph for a blog post.",
    "What are common misconceptions about {t}?", "Write a short story that involves {t}.",
]
STDLIB_TEMPLATES = [
    "What does `{mod}.{qual}` do in Python?",
    "Show a short example of how to use `{qual}` from the Python `{mod}` module.",
    "Explain the following Python code:\n\n```python\n{src}\n```",
    "Write a Python function that does the following: {first}",
    "Add comments to this Python code:\n\n```python\n{src}\n```",
    "Is there anything that could be improved in this code?\n\n```python\n{src}\n```",
    "Write a unit test for this function:\n\n```python\n{src}\n```",
    "In one sentence, what does this Python code do?\n\n```python\n{src}\n```",
]
# Everyday tasks, as users ask a chat model (emails, recipes, how-tos, small programs, queries,
# comparisons, translations): one template per kind, each with its own slot values. Kept apart
# from the held-out prompts' wording (models/draft/heldout_prompts.txt; exact matches are dropped).
TASK_TEMPLATES = {
    "Write a polite email to {who} about {what}.": {
        "who": ["my landlord", "a colleague", "my professor", "a customer", "my team", "a neighbour", "a recruiter",
                "the school", "a supplier", "my doctor's office"],
        "what": ["a broken heater", "rescheduling our meeting to Thursday", "a late assignment", "a refund request",
                 "the project's status", "noise late at night", "a job offer I want to accept", "a missing package",
                 "an invoice that was paid twice", "taking a week of vacation in August"]},
    "Give me a simple recipe for {dish}.": {
        "dish": ["tomato soup", "banana bread", "fried rice", "guacamole", "an omelette", "lentil curry",
                 "pasta salad", "chocolate chip cookies", "hummus", "a vegetable stir-fry", "French toast",
                 "chicken noodle soup", "a fruit smoothie", "mashed potatoes", "garlic bread", "apple crumble"]},
    "How do I {task}?": {
        "task": ["change a flat tire", "improve my sleep", "start running as a beginner", "prepare for a job interview",
                 "learn a new language on my own", "save money on groceries", "write a good cover letter",
                 "remove a coffee stain from a shirt", "back up my phone", "set up a monthly budget",
                 "make my houseplants last longer", "ask for a raise", "reset a forgotten Wi-Fi password",
                 "install Python packages with pip", "undo the last commit in Git", "center a div with CSS"]},
    "Write a Python function that {does}.": {
        "does": ["reverses the words in a sentence", "returns the n-th Fibonacci number",
                 "removes duplicates from a list while keeping the order", "counts the vowels in a string",
                 "merges two sorted lists", "checks whether a number is prime", "flattens a nested list",
                 "converts Celsius to Fahrenheit", "finds the most common word in a text",
                 "checks whether two strings are anagrams", "computes the factorial of a number",
                 "returns the second largest number in a list", "validates an email address with a regex",
                 "reads a JSON file and returns a dictionary", "splits a list into chunks of size n"]},
    "Write a SQL query that {does}.": {
        "does": ["finds the average salary per department in a table called employees",
                 "lists the customers who have never placed an order", "counts the orders per month",
                 "returns the five best-selling products", "deletes duplicate rows from a table called users",
                 "finds employees who earn more than their manager", "joins orders with customers by customer_id"]},
    "Write a shell command that {does}.": {
        "does": ["finds all files larger than 100 MB", "renames every .jpeg file in a folder to .jpg",
                 "shows the ten largest directories", "counts how many times a word appears in a file",
                 "deletes log files older than seven days", "lists the processes using the most memory",
                 "compresses a folder into a tar.gz archive"]},
    "Explain the difference between {a}.": {
        "a": ["a process and a thread", "HTTP and HTTPS", "RAM and storage", "a virus and a bacterium",
              "stocks and bonds", "latitude and longitude", "a compiler and an interpreter", "speed and velocity",
              "a simile and a metaphor", "mitosis and meiosis", "`==` and `is` in Python", "a stack and a queue",
              "affect and effect", "a credit card and a debit card"]},
    "What does {feature} do in Python?": {
        "feature": ["`enumerate`", "`zip`", "a decorator", "the `with` statement", "a list comprehension",
                    "`*args` and `**kwargs`", "`__init__`", "the `global` keyword", "`lambda`", "`try` / `except`",
                    "`map` and `filter`", "an f-string"]},
    "Give me {n} ideas for {occasion}.": {
        "n": ["three", "four", "five", "six"],
        "occasion": ["a birthday party on a budget", "a team-building activity", "a science fair project",
                     "a healthy breakfast", "a first date", "a short weekend trip", "a gift for my father",
                     "a blog about cooking", "a family game night", "a small garden on a balcony"]},
    "Translate \"{phrase}\" into {lang}.": {
        "phrase": ["Where is the train station?", "Thank you for your help.", "I would like a cup of coffee.",
                   "What time does the store open?", "Nice to meet you.", "I am learning to cook."],
        "lang": ["German", "Italian", "Spanish", "Portuguese", "French and German", "Italian and Spanish"]},
    "Summarize the plot of {work} in {k} sentences.": {
        "work": ["Hamlet", "Pride and Prejudice", "The Odyssey", "Moby-Dick", "Macbeth", "Cinderella",
                 "The Little Prince", "Frankenstein", "Alice in Wonderland", "The Great Gatsby"],
        "k": ["two", "three", "four"]},
    "Write a short {kind} for {occasion}.": {
        "kind": ["speech", "toast", "thank-you note", "message", "announcement"],
        "occasion": ["my sister's wedding", "a retiring colleague", "a friend's graduation", "a team that hit its goal",
                     "a new neighbour", "the end of a school year"]},
    "How does {thing} work?": {
        "thing": ["a microwave oven", "a touchscreen", "a solar panel", "an electric motor", "GPS", "a vaccine",
                  "a credit score", "a search engine", "a hybrid car", "Wi-Fi", "a thermostat", "a password manager"]},
    "Why {question}?": {
        "question": ["is the sky blue", "do we have leap years", "does ice float on water", "do cats purr",
                     "do we yawn", "is the ocean salty", "do onions make you cry", "does bread go stale",
                     "do airplanes leave white trails", "do we dream"]},
}


# The second task set (``train_head.py data --task-set 2``: both sets): more kinds of request and
# more slot values, the first set's 345 distinct prompts having repeated ~4x in the sixth run's
# shards. Same rule: nothing here is a held-out prompt or its subject.
TASK_TEMPLATES_MORE = {
    "Write a Python class that represents {thing}.": {
        "thing": ["a bank account", "a shopping cart", "a to-do list", "a deck of cards", "a library book",
                  "a 2D point", "a simple timer", "a student with grades", "an inventory of products",
                  "a queue with a maximum size", "a temperature log", "a playlist of songs"]},
    "Write a JavaScript function that {does}.": {
        "does": ["capitalizes the first letter of every word", "returns the largest number in an array",
                 "debounces another function", "checks whether a year is a leap year",
                 "shuffles an array", "formats a date as YYYY-MM-DD", "sums the values of an object",
                 "removes falsy values from an array", "counts the characters in a string"]},
    "Write a regular expression that matches {what}, and explain it.": {
        "what": ["a US phone number", "a date like 2024-05-17", "an IPv4 address", "a hexadecimal color code",
                 "a word that starts with a capital letter", "a time like 14:30", "a postal code with five digits"]},
    "What are the benefits of {thing}?": {
        "thing": ["drinking enough water", "regular exercise", "reading every day", "learning to code",
                  "writing unit tests", "walking to work", "keeping a journal", "using a password manager",
                  "eating more vegetables", "code reviews", "taking short breaks", "cycling in the city"]},
    "What are common mistakes when {doing}?": {
        "doing": ["learning Python", "writing a resume", "baking bread", "starting a business",
                  "training for a 10k run", "giving a presentation", "investing for the first time",
                  "designing a database", "painting a room", "learning to drive"]},
    "Create a one-week {plan} for {who}.": {
        "plan": ["study plan", "workout plan", "meal plan", "reading plan"],
        "who": ["a beginner", "a busy student", "someone learning Spanish", "a software developer",
                "a family of four", "someone preparing for an exam"]},
    "Rewrite this sentence to sound more {tone}: \"{sentence}\"": {
        "tone": ["formal", "friendly", "concise", "polite", "confident"],
        "sentence": ["I can't come to the meeting tomorrow.", "Send me the report as soon as possible.",
                     "Your product didn't work and I want my money back.", "We need to talk about the budget.",
                     "The deadline is moved to next week.", "I think your idea is not very good."]},
    "What should I pack for {trip}?": {
        "trip": ["a weekend camping trip", "a business trip to London", "a beach holiday", "a ski trip",
                 "a long flight", "a hiking day in the mountains", "a week in Japan"]},
    "Suggest {n} names for {thing}.": {
        "n": ["five", "ten", "three"],
        "thing": ["a coffee shop", "a golden retriever puppy", "a personal finance app", "a book club",
                  "a bakery", "a podcast about history", "a startup that sells plants", "a fantasy kingdom"]},
    "Write a short product description for {product}.": {
        "product": ["a reusable water bottle", "noise-cancelling headphones", "a standing desk",
                    "an electric kettle", "a backpack for laptops", "a smart watch", "a wooden chess set"]},
    "Explain {concept} step by step.": {
        "concept": ["how to solve a quadratic equation", "how to compute a percentage", "long division",
                    "how a loan's interest is calculated", "how to convert binary to decimal",
                    "how to find the area of a circle", "how a bill becomes a law", "how bread rises"]},
    "What is {term} in {field}?": {
        "term": ["a variable", "an API", "a dividend", "an index", "a function", "a bond", "a cache",
                 "a hypothesis", "a catalyst", "a mortgage"],
        "field": ["programming", "finance", "databases", "chemistry", "science", "economics"]},
    "Write a limerick about {t}.": {
        "t": ["a lazy cat", "a programmer who loves coffee", "a forgetful wizard", "a rainy Monday",
              "a dog who chases its tail", "a broken umbrella"]},
    "What causes {thing}?": {
        "thing": ["thunder", "hiccups", "inflation", "earthquakes", "jet lag", "headaches", "rust on iron",
                  "traffic jams", "tides", "wind"]},
    "Convert this list into a JSON array of objects with the fields name and age: {people}": {
        "people": ["Alice 30, Bob 25, Carol 41", "Dan 19, Eve 52", "Frank 33, Grace 28, Heidi 64, Ivan 45",
                   "Judy 22, Mallory 37"]},
    "Find the bug in this Python code and fix it:\n\n```python\n{code}\n```": {
        "code": ["def average(xs):\n    return sum(xs) / len(xs) + 1",
                 "def last(items):\n    return items[len(items)]",
                 "for i in range(10)\n    print(i)",
                 "def is_even(n):\n    return n % 2 == 1",
                 "names = ['a', 'b']\nfor i in range(len(names) + 1):\n    print(names[i])",
                 "def count(words):\n    d = {}\n    for w in words:\n        d[w] += 1\n    return d"]},
    "Give me a short overview of {place}.": {
        "place": ["Iceland", "Kyoto", "the Grand Canyon", "Buenos Aires", "the Alps", "New Zealand",
                  "Istanbul", "the Great Barrier Reef", "Canada", "Morocco"]},
    "How can I {goal} in Python?": {
        "goal": ["sort a dictionary by its values", "download a web page", "measure how long a function takes",
                 "remove whitespace from a string", "get the current date and time", "read a text file line by line",
                 "run a shell command", "generate a random password", "copy a file", "parse command-line arguments"]},
}


def task_prompt(rng: random.Random, task_set: int = 1) -> str:
    """One prompt from :data:`TASK_TEMPLATES` (``task_set`` 2: or :data:`TASK_TEMPLATES_MORE`): a
    template, then a value for each of its slots."""
    templates = TASK_TEMPLATES if task_set == 1 else {**TASK_TEMPLATES, **TASK_TEMPLATES_MORE}
    template = rng.choice(sorted(templates))
    return template.format(**{k: rng.choice(v) for k, v in templates[template].items()})


MAN_TEMPLATES = [
    "What does the `{cmd}` command do?", "How do I {desc} on Linux?",
    "Give me two examples of using `{cmd}`.", "Explain what `{cmd}` is used for.",
    "Summarize this manual page excerpt:\n\n{excerpt}",
]
DOC_TEMPLATES = [
    "Summarize this paragraph:\n\n{p}", "Explain this in simpler words:\n\n{p}",
    "Write a question and its answer based on this text:\n\n{p}",
    "What is the main point of this text?\n\n{p}", "Explain {title} in Python.",
]


def rst_paragraphs(text: str) -> tuple[list[str], list[str]]:
    paras, titles = [], []
    blocks = re.split(r"\n\s*\n", text)
    for i, b in enumerate(blocks):
        lines = b.strip("\n").splitlines()
        if len(lines) == 2 and re.fullmatch(r"[=\-~^*]{3,}", lines[1].strip()) and 3 < len(lines[0]) < 60:
            titles.append(lines[0].strip())
        flat = " ".join(l.strip() for l in lines)
        if 200 <= len(flat) <= 900 and not flat.startswith((".. ", ":", "+", "|", ">>>")) and "::" not in flat[-3:]:
            paras.append(flat)
    return paras, titles


def excerpt(text: str, rng: random.Random, min_chars: int, max_chars: int) -> str:
    """A run of whole lines from ``text``, between min_chars and max_chars long."""
    lines = text.splitlines(keepends=True)
    if not lines:
        return ""
    for _ in range(8):
        i = rng.randrange(len(lines))
        out = ""
        for line in lines[i:]:
            if len(out) + len(line) > max_chars:
                break
            out += line
        if len(out.strip()) >= min_chars:
            return out.rstrip("\n") + "\n"
    return ""


def cmd_corpus(args):
    rng = random.Random(args.seed)
    data = Path(args.data_dir)
    cdir = data / "corpus"
    cdir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer
    from sequoia_decoding.modeling.smollm2 import ensure_target

    tok = AutoTokenizer.from_pretrained(ensure_target())

    log("collecting stdlib")
    py = stdlib_files()
    docs = {"stdlib": [read_text_file(p) for p in py]}
    log(f"stdlib: {len(py)} files")
    rst = rst_files()
    docs["pydoc"] = [read_text_file(p) for p in rst]
    log(f"python3.11-doc: {len(rst)} files")
    man = man_files(rng, args.max_man_pages)
    docs["man"] = []
    for i, p in enumerate(man):
        t = render_man(p)
        if len(t) > 200:
            docs["man"].append(t)
        if i % 500 == 0:
            log(f"man {i}/{len(man)}")
    log(f"man: {len(docs['man'])} pages")

    stats = {}
    for src, texts in docs.items():
        ids, offsets = [], [0]
        for t in texts:
            t_ids = encode(tok, t) + [0]  # <|endoftext|> between documents
            ids += t_ids
            offsets.append(len(ids))
        np.save(cdir / f"{src}.tokens.npy", np.asarray(ids, dtype=np.uint16))
        np.save(cdir / f"{src}.offsets.npy", np.asarray(offsets, dtype=np.int64))
        stats[src] = {"docs": len(texts), "tokens": len(ids), "chars": sum(map(len, texts))}
        log(src, stats[src])
        (cdir / f"{src}.texts.json").write_text(json.dumps(texts))

    atomic_write_text(data / "corpus-stats.json", json.dumps(stats, indent=2))
    build_prompts(data, args.seed, args.num_prompts)


def man_name_lines(man_texts: list[str]) -> list[tuple[str, str]]:
    out = []
    for t in man_texts:
        m = re.search(r"^NAME\n\s+(\S.*?)\s+[-\u2010\u2013\u2014]+\s+(.+)$", t, re.M)
        if m:
            out.append((m.group(1).split(",")[0].strip(), m.group(2).strip().rstrip(".")))
    return out


def build_prompts(data: Path, seed: int, n: int) -> None:
    """Write ``prompts-train.jsonl`` from the saved corpus texts (deterministic)."""
    rng = random.Random(seed + 1)
    docs = {s: json.loads((data / "corpus" / f"{s}.texts.json").read_text()) for s in ("stdlib", "pydoc", "man")}
    items = list(stdlib_items(stdlib_files()))
    man_names = man_name_lines(docs["man"])
    heldout = read_prompts(HELDOUT_REPO)
    held_texts = {p["text"].strip() for p in heldout}
    topics = [t.strip() for t in GENERAL_TOPICS.split("|") if t.strip()]
    paras, titles = [], []
    for t in docs["pydoc"]:
        p, ti = rst_paragraphs(t)
        paras += p
        titles += ti
    mix = [("chat_general", 0.25), ("chat_stdlib", 0.20), ("chat_doc", 0.10), ("chat_man", 0.10),
           ("raw_stdlib", 0.20), ("raw_pydoc", 0.08), ("raw_man", 0.07)]
    prompts = []
    for i in range(n):
        r, acc = rng.random(), 0.0
        for kind, w in mix:
            acc += w
            if r < acc:
                break
        if kind == "chat_general":
            text = rng.choice(GENERAL_TEMPLATES).format(t=rng.choice(topics))
        elif kind == "chat_stdlib":
            mod, qual, first, src = rng.choice(items)
            text = rng.choice(STDLIB_TEMPLATES).format(mod=mod, qual=qual, first=first, src=src)
        elif kind == "chat_doc":
            tmpl = rng.choice(DOC_TEMPLATES)
            text = tmpl.format(p=rng.choice(paras), title=rng.choice(titles))
        elif kind == "chat_man":
            cmd, desc = rng.choice(man_names)
            text = rng.choice(MAN_TEMPLATES).format(
                cmd=cmd, desc=desc[:1].lower() + desc[1:],
                excerpt=excerpt(rng.choice(docs["man"]), rng, 200, 700))
        else:
            src = kind.split("_", 1)[1]
            text = excerpt(rng.choice(docs[src]), rng, 80, 500)
            cut = rng.random()
            if cut < 0.4:  # end mid-line, like many real prompts
                words = text.rstrip("\n").split(" ")
                text = " ".join(words[: max(2, int(len(words) * rng.uniform(0.5, 0.95)))])
            elif cut < 0.7:
                text = text.rstrip("\n")
        if not text.strip() or text.strip() in held_texts:
            continue
        prompts.append({"id": len(prompts), "kind": "chat" if kind.startswith("chat") else "raw",
                        "source": kind, "text": text})
    with open(data / "prompts-train.jsonl.tmp", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    os.replace(data / "prompts-train.jsonl.tmp", data / "prompts-train.jsonl")
    atomic_write_text(data / "heldout_prompts.txt", HELDOUT_REPO.read_text())
    log(f"wrote {len(prompts)} training prompts ({len(items)} stdlib defs, {len(man_names)} man NAME "
        f"lines, {len(paras)} doc paragraphs); held-out: {len(heldout)}")


def cmd_prompts(args):
    build_prompts(Path(args.data_dir), args.seed, args.num_prompts)


# ---------------------------------------------------------------------------------------
# teacher labelling helpers
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def teacher_topk(logits: torch.Tensor, k: int = TOPK):
    """``logits`` [N, V_full] fp32 -> (ids [N, k] uint16, logits [N, k] fp16, lse [N] fp32)."""
    vals, ids = logits.float().topk(k, dim=-1)
    lse = torch.logsumexp(logits.float(), dim=-1)
    return ids.numpy().astype(np.uint16), vals.numpy().astype(np.float16), lse.numpy().astype(np.float32)


@torch.no_grad()
def hidden_to_topk(model, hidden: torch.Tensor, chunk: int = 512):
    """Final hidden states [N, D] -> teacher top-k, chunked to bound memory."""
    outs = [teacher_topk(model.lm_head(hidden[i:i + chunk])) for i in range(0, hidden.shape[0], chunk)]
    return tuple(np.concatenate(x) for x in zip(*outs))


def pack_shard(seqs: list[dict]) -> dict:
    """``seqs``: dicts with tokens [L], topk_ids [L, K], topk_logits [L, K], lse [L], meta."""
    offsets = np.cumsum([0] + [len(s["tokens"]) for s in seqs]).astype(np.int64)
    return dict(
        tokens=np.concatenate([np.asarray(s["tokens"], dtype=np.uint16) for s in seqs]),
        offsets=offsets,
        topk_ids=np.concatenate([s["topk_ids"] for s in seqs]),
        topk_logits=np.concatenate([s["topk_logits"] for s in seqs]),
        lse=np.concatenate([s["lse"] for s in seqs]),
        meta=np.asarray(json.dumps([s["meta"] for s in seqs])),
    )


# ---------------------------------------------------------------------------------------
# generate: target-generated continuations with free teacher labels
# ---------------------------------------------------------------------------------------

def load_train_prompts(data: Path) -> list[dict]:
    with open(data / "prompts-train.jsonl") as f:
        return [json.loads(line) for line in f]


def shard_temperature(index: int) -> float:
    """Sampling temperature of generation shard ``index``: 0.7 half the time, else 0 / 1."""
    return (0.7, 0.0, 0.7, 1.0)[index % 4]


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new: list[int], temperature: float,
                   gen: torch.Generator, k: int = TOPK) -> list[dict]:
    """Sample continuations for a batch of prompts (left-padded, KV cache), keeping the
    teacher top-k at every real position. Returns one record per prompt."""
    from transformers import DynamicCache

    B = len(prompts)
    P = max(map(len, prompts))
    ids = torch.full((B, P), PAD_ID, dtype=torch.long)  # [B, P]
    mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, P]
    cache = DynamicCache()
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True).last_hidden_state  # [B, P, D]
    recs = []
    for b, p in enumerate(prompts):
        t_ids, t_val, t_lse = hidden_to_topk(model, hidden[b, P - len(p):])
        recs.append({"tokens": list(p), "topk_ids": [t_ids], "topk_logits": [t_val], "lse": [t_lse],
                     "prompt_len": len(p), "done": False})
    last = model.lm_head(hidden[:, -1]).float()  # [B, V_full]
    alive = list(range(B))  # batch row -> record index
    next_pos = pos[:, -1] + 1  # [B]
    step = 0
    while alive:
        if temperature > 0:
            probs = torch.softmax(last / temperature, dim=-1)  # [B', V_full]
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]  # [B']
        else:
            nxt = last.argmax(-1)  # [B']
        step += 1
        keep = []
        for row, r in enumerate(alive):
            tok_id = int(nxt[row])
            recs[r]["tokens"].append(tok_id)
            n_gen = len(recs[r]["tokens"]) - recs[r]["prompt_len"]
            if tok_id in EOS_IDS or n_gen >= max_new[r]:
                recs[r]["done"] = True
            else:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            sel = torch.tensor(keep)
            cache.batch_select_indices(sel)
            mask, nxt, next_pos = mask[sel], nxt[sel], next_pos[sel]
            alive = [alive[i] for i in keep]
        mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=torch.long)], dim=1)  # [B', P+step]
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        last = out.logits[:, -1].float()  # [B', V_full]
        t_ids, t_val, t_lse = teacher_topk(last, k)
        for row, r in enumerate(alive):
            recs[r]["topk_ids"].append(t_ids[row:row + 1])
            recs[r]["topk_logits"].append(t_val[row:row + 1])
            recs[r]["lse"].append(t_lse[row:row + 1])
        next_pos = next_pos + 1
    out = []
    for r in recs:
        L = len(r["tokens"])
        ids_ = np.concatenate(r["topk_ids"])
        # The last sampled token never got a forward (finished): drop its label-less row.
        n = min(L, ids_.shape[0])
        out.append({"tokens": r["tokens"][:n], "topk_ids": ids_[:n],
                    "topk_logits": np.concatenate(r["topk_logits"])[:n],
                    "lse": np.concatenate(r["lse"])[:n], "prompt_len": r["prompt_len"]})
    return out


def make_generation_shard(model, tok, data: Path, index: int, seed: int, batch: int = 32,
                          max_new_chat: int = 320, max_new_raw: int = 160, max_prompt: int = 384):
    """Generate shard ``index`` (prompts ``index*batch ... +batch``); idempotent."""
    path = data / "gen" / f"shard-{index:05d}.npz"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = load_train_prompts(data)[index * batch:(index + 1) * batch]
    if not prompts:
        raise IndexError(f"no training prompts left for shard {index}")
    temperature = shard_temperature(index)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    p_ids = [prompt_ids(tok, p)[-max_prompt:] for p in prompts]
    max_new = [max_new_chat if p["kind"] == "chat" else max_new_raw for p in prompts]
    t0 = time.time()
    recs = generate_batch(model, p_ids, max_new, temperature, gen)
    seqs = []
    for p, r in zip(prompts, recs):
        r["meta"] = {"prompt_id": p["id"], "kind": p["kind"], "source": p["source"],
                     "prompt_len": r["prompt_len"], "temperature": temperature}
        seqs.append(r)
    atomic_save_npz(path, **pack_shard(seqs))
    n_gen = sum(len(r["tokens"]) - r["prompt_len"] for r in recs)
    log(f"gen shard {index}: T={temperature} {n_gen} new tokens, "
        f"{sum(len(r['tokens']) for r in recs)} labelled, {time.time() - t0:.0f}s "
        f"({n_gen / (time.time() - t0):.1f} new tok/s)")
    return path


def cmd_generate(args):
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    model, tok = load_target(attn_implementation="sdpa")  # same path as train_draft.py
    for i in range(args.start, args.until):
        make_generation_shard(model, tok, data, i, args.seed, batch=args.batch)


# ---------------------------------------------------------------------------------------
# label: teacher-forced top-k on corpus windows
# ---------------------------------------------------------------------------------------

LABEL_SOURCES = (("stdlib", 0.45), ("pydoc", 0.35), ("man", 0.20))


def corpus_windows(data: Path, index: int, seed: int, n: int, length: int):
    """``n`` windows of ``length`` tokens for label shard ``index`` (deterministic)."""
    rng = np.random.default_rng([seed, index, 7])
    cdir = data / "corpus"
    out = []
    arrays = {s: (np.load(cdir / f"{s}.tokens.npy", mmap_mode="r"), np.load(cdir / f"{s}.offsets.npy"))
              for s, _ in LABEL_SOURCES}
    names = [s for s, _ in LABEL_SOURCES]
    weights = np.array([w for _, w in LABEL_SOURCES])
    for _ in range(n):
        src = names[rng.choice(len(names), p=weights / weights.sum())]
        toks, offs = arrays[src]
        d = int(rng.integers(len(offs) - 1))
        a, b = int(offs[d]), int(offs[d + 1])
        start = a if b - a <= length or rng.random() < 0.3 else int(rng.integers(a, b - length))
        out.append((src, d, np.asarray(toks[start:min(b, start + length)], dtype=np.int64)))
    return out


@torch.no_grad()
def make_label_shard(model, data: Path, index: int, seed: int, n: int = 64, length: int = 256, batch: int = 8):
    path = data / "lab" / f"shard-{index:05d}.npz"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    seqs = []
    wins = corpus_windows(data, index, seed, n, length)
    for i in range(0, n, batch):
        chunk = wins[i:i + batch]
        L = max(len(w) for _, _, w in chunk)
        ids = torch.full((len(chunk), L), PAD_ID, dtype=torch.long)  # right padding: causal => harmless
        for b, (_, _, w) in enumerate(chunk):
            ids[b, :len(w)] = torch.from_numpy(w)
        hidden = model.model(input_ids=ids).last_hidden_state  # [b, L, D]
        for b, (src, d, w) in enumerate(chunk):
            t_ids, t_val, t_lse = hidden_to_topk(model, hidden[b, :len(w)])
            seqs.append({"tokens": w, "topk_ids": t_ids, "topk_logits": t_val, "lse": t_lse,
                         "meta": {"source": src, "doc": d}})
    atomic_save_npz(path, **pack_shard(seqs))
    ntok = sum(len(s["tokens"]) for s in seqs)
    log(f"label shard {index}: {ntok} tokens, {time.time() - t0:.0f}s ({ntok / (time.time() - t0):.0f} tok/s)")
    return path


def cmd_label(args):
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    model, _ = load_target(attn_implementation="sdpa")
    for i in range(args.start, args.until):
        make_label_shard(model, data, i, args.seed)


# ---------------------------------------------------------------------------------------
# vocab
# ---------------------------------------------------------------------------------------

def shard_paths(data: Path, kind: str) -> list[Path]:
    return sorted((data / kind).glob("shard-*.npz"))


def teacher_mass(paths: list[Path], vocab: int = 49152) -> tuple[np.ndarray, np.ndarray]:
    """Sum of teacher probability (top-k part) and argmax counts per token over all rows."""
    mass = np.zeros(vocab, np.float64)
    top1 = np.zeros(vocab, np.int64)
    for p in paths:
        z = np.load(p)
        prob = np.exp(z["topk_logits"].astype(np.float32) - z["lse"][:, None])  # [N, K]
        np.add.at(mass, z["topk_ids"].astype(np.int64).ravel(), prob.ravel())
        np.add.at(top1, z["topk_ids"][:, 0].astype(np.int64), 1)
    return mass, top1


def build_vocab(data: Path, size: int, gen_weight: float = 3.0) -> tuple[np.ndarray, dict]:
    """Kept target ids (most teacher mass first; special ids 0-2 always kept) + coverage."""
    gen_p, lab_p = shard_paths(data, "gen"), shard_paths(data, "lab")
    if not gen_p and not lab_p:
        raise FileNotFoundError(f"no labelled shards under {data}: run generate/label first")
    gm, gt = teacher_mass(gen_p)
    lm, lt = teacher_mass(lab_p)
    score = gen_weight * gm / max(gm.sum(), 1e-9) + lm / max(lm.sum(), 1e-9)
    score[[0, 1, 2]] = np.inf
    kept = np.argsort(-score, kind="stable")[:size]
    sel = np.zeros(score.shape[0], bool)
    sel[kept] = True
    stats = {"size": int(size), "gen_shards": len(gen_p), "lab_shards": len(lab_p),
             "gen_mass_covered": float(gm[sel].sum() / max(gm.sum(), 1e-9)),
             "gen_top1_covered": float(gt[sel].sum() / max(gt.sum(), 1)),
             "lab_mass_covered": float(lm[sel].sum() / max(lm.sum(), 1e-9)),
             "lab_top1_covered": float(lt[sel].sum() / max(lt.sum(), 1))}
    return kept.astype(np.int64), stats


def cmd_vocab(args):
    data = Path(args.data_dir)
    for size in args.sizes:
        kept, stats = build_vocab(data, size)
        if args.write:
            np.save(data / f"vocab-{size}.npy", kept)
            atomic_write_text(data / f"vocab-{size}.json", json.dumps(stats, indent=2))
        log(json.dumps(stats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(DATA_DIR))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--max-man-pages", type=int, default=2500)
    c.add_argument("--num-prompts", type=int, default=40000)
    pr = sub.add_parser("prompts", help="rebuild prompts-train.jsonl from the saved corpus texts")
    pr.add_argument("--num-prompts", type=int, default=40000)
    g = sub.add_parser("generate")
    g.add_argument("--start", type=int, default=0)
    g.add_argument("--until", type=int, required=True, help="generate shards [start, until)")
    g.add_argument("--batch", type=int, default=32)
    lb = sub.add_parser("label")
    lb.add_argument("--start", type=int, default=0)
    lb.add_argument("--until", type=int, required=True)
    v = sub.add_parser("vocab")
    v.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 14336, 16384])
    v.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    {"corpus": cmd_corpus, "prompts": cmd_prompts, "generate": cmd_generate, "label": cmd_label, "vocab": cmd_vocab}[args.cmd](args)


if __name__ == "__main__":
    main()
