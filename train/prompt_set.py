"""The embedded prompt set: varied instruction prompts written for this project, generated from templates.

    python -m specdec.train.prompt_set          # regenerate train/assets/prompts_{train,heldout}.jsonl (same bytes)
    python -m specdec.train.prompt_set --check  # exit 1 when the shipped files differ from what this code generates

Thirteen kinds of task, each built from templates and topic lists below. Every kind's topics are split once
(seeded) into train topics and held-out topics, so the held-out prompts are about things the train prompts
never mention, not merely rewordings of them. Records: {"prompt_id", "category", "messages": [user turns]};
a `follow-up` record has two user turns (the target answers the first, then the second after its own answer).
None of this text comes from MT-Bench or Spec-Bench (tests/test_data.py checks).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED_TRAIN_PROMPTS = ASSETS / "prompts_train.jsonl"
EMBEDDED_HELDOUT_PROMPTS = ASSETS / "prompts_heldout.jsonl"
SEED = 20261130
TRAIN_PER_KIND = 130
HELDOUT_TOTAL = 150
HELDOUT_TOPIC_FRACTION = 0.12

# --------------------------------------------------------------------------------------------------------
# Explanation

CONCEPTS = [
    "compound interest", "how vaccines teach the immune system", "inflation", "the water cycle", "plate tectonics",
    "how a refrigerator keeps food cold", "public-key encryption", "why the sky looks blue", "supply and demand",
    "how GPS works out your position", "black holes", "the greenhouse effect", "natural selection",
    "how noise-cancelling headphones work", "opportunity cost", "the difference between weather and climate",
    "why bread dough rises", "why leaves change colour in autumn", "how a search engine ranks pages",
    "the placebo effect", "how ocean tides work", "what a blockchain is", "how muscles grow after exercise",
    "why ice floats on water", "how interest rates affect house prices", "the Doppler effect", "how credit scores work",
    "what DNS does when you open a website", "how rechargeable batteries store energy", "comparative advantage in trade",
    "how aeroplane wings produce lift", "what causes earthquakes", "how the heart pumps blood", "what an API is",
    "how plastic recycling works", "why we have time zones", "the scientific method", "how antibiotic resistance develops",
    "what a recession is", "how solar panels make electricity", "the difference between short-term and long-term memory",
    "how a bicycle stays upright", "what causes the seasons", "how yeast ferments sugar", "how a mortgage works",
    "what a stock index measures", "why the moon has phases", "how a compiler turns source code into a program",
    "entropy in everyday terms", "how honeybees tell each other where flowers are", "how sound travels through air",
    "how a microwave oven heats food", "how a hash table finds things quickly", "the Pythagorean theorem",
    "how rainbows form", "what a central bank does", "how radiocarbon dating works", "how hurricanes form",
    "why salt melts ice on roads", "how a touchscreen senses your finger", "what a carbon footprint is",
    "how the immune system recognises germs", "why some materials conduct electricity and others do not",
    "how compound words form in English", "what a logarithm is", "how a camera lens focuses light",
]
AUDIENCES = ["a ten-year-old", "a high-school student", "a busy manager", "my grandmother", "a first-year university student",
             "someone who has never studied science", "a new employee"]
EXPLAIN_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to {a}?",
    "Give me a short explanation of {t}, with one everyday example.",
    "I have never really understood {t}. Could you walk me through it?",
    "Explain {t} using an analogy.",
    "In three short paragraphs, explain {t}.",
    "What are the most common misconceptions about {t}?",
    "Write a brief explanation of {t} for {a}.",
    "Why does {t} matter in daily life? Keep the answer short.",
]


def _explanation(topic: str, rng: random.Random) -> list[list[str]]:
    return [[t.format(t=topic, a=rng.choice(AUDIENCES))] for t in EXPLAIN_TEMPLATES]


# --------------------------------------------------------------------------------------------------------
# How-to

TASKS = [
    "make a simple monthly budget", "start running as a complete beginner", "keep basil alive on a windowsill",
    "prepare for a job interview", "learn to touch type", "fix a squeaky door hinge", "write a cover letter",
    "brew pour-over coffee", "back up the photos on my phone", "unclog a kitchen sink without chemicals",
    "teach a puppy to sit", "plan a week of vegetarian dinners", "choose strong passwords I can remember",
    "set up a compost bin at home", "iron a dress shirt", "organise a small wardrobe", "study for an exam in two weeks",
    "change a flat bicycle tyre", "give a five-minute presentation", "reduce my screen time", "bake a loaf of sourdough",
    "paint a bedroom wall", "negotiate a salary offer", "save money on groceries", "fall asleep faster",
    "learn the basic rules of chess", "clean a cast-iron pan", "write a clear bug report", "start keeping a journal",
    "meditate for ten minutes a day", "sew a button back on", "set up a small freshwater aquarium",
    "remove a coffee stain from a cotton shirt", "pick a ripe watermelon", "read more books this year",
    "hang a picture frame straight", "make a good first impression at a new job", "plan a three-day road trip",
    "host a dinner party for six people", "keep houseplants alive while I am on holiday", "run a short team meeting",
    "take better photos with my phone", "grow tomatoes on a balcony", "write a thank-you note",
    "pack a carry-on bag efficiently", "make fresh pasta by hand", "keep track of my spending",
    "get a house ready for winter", "memorise a short speech", "learn to juggle three balls",
    "check my car's oil and tyre pressure", "set realistic goals for the new year", "build a one-page personal website",
    "light a campfire safely", "cook fluffy rice on the stove", "clean a laptop keyboard", "train for a 5 km race",
    "descale an electric kettle", "write a good product review", "start learning to draw",
]
HOWTO_TEMPLATES = [
    "How do I {t}?",
    "What's the best way to {t}?",
    "Give me step-by-step instructions to {t}.",
    "I'm a beginner. How can I {t}?",
    "List the steps to {t}, and mention the most common mistakes.",
    "Explain how to {t} in five steps or fewer.",
    "What do I need in order to {t}, and how long will it take?",
    "My first attempt to {t} went badly. What should I do differently?",
]


def _howto(topic: str, rng: random.Random) -> list[list[str]]:
    return [[t.format(t=topic)] for t in HOWTO_TEMPLATES]


# --------------------------------------------------------------------------------------------------------
# Coding

CODE_SPECS = [
    "reverses the order of the words in a sentence", "checks whether a string reads the same backwards",
    "counts how often each word appears in a text", "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order", "converts a temperature from Celsius to Fahrenheit",
    "finds the second largest number in a list", "checks that an email address has a plausible format",
    "flattens a nested list of any depth", "computes the greatest common divisor of two integers",
    "checks whether two words are anagrams of each other", "returns all prime numbers below n",
    "groups a list of words by their first letter", "computes a moving average over a list of numbers",
    "returns the weekday of a date given as 'YYYY-MM-DD'", "finds the longest common prefix of a list of strings",
    "rotates a list to the right by k positions", "capitalises the first letter of every word in a string",
    "converts a Roman numeral to an integer", "performs a binary search on a sorted list",
    "counts the vowels in a string", "transposes a matrix stored as a list of lists",
    "returns the running totals of a list of numbers", "splits a list into chunks of size n",
    "checks whether the brackets in a string are balanced", "converts a non-negative integer to binary without built-ins",
    "finds the most common element in a list", "sorts a list of records by a given field",
    "computes the dot product of two vectors", "generates a random password of a given length",
    "removes punctuation from a string", "checks whether a year is a leap year",
    "implements a stack with push, pop and peek", "sums one column of a CSV file",
    "finds all pairs of numbers in a list that add up to a target", "counts the lines in a text file",
    "compresses a string with run-length encoding", "returns the items two lists have in common",
    "converts a snake_case name to camelCase", "checks whether a number is a perfect square",
    "finds the first character that repeats in a string", "implements a queue using two stacks",
    "formats a number of seconds as hours, minutes and seconds", "shortens a string to a maximum length with an ellipsis",
    "computes the area of a polygon from its corner points", "checks whether a sudoku row is valid",
    "returns the n largest values of a list without sorting all of it", "turns a list of pairs into a dictionary",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C"]
CODE_TEMPLATES = [
    "Write a {l} function that {t}.",
    "In {l}, how would I write a function that {t}? Include a short usage example.",
    "Write a {l} function that {t}, and state its time complexity.",
    "Implement a function in {l} that {t}. Add two or three test cases.",
    "Show me an idiomatic {l} function that {t}, with a docstring or comment explaining it.",
]
BUGGY_SNIPPETS = [  # (code, what it does wrong, the same as a bare verb phrase)
    ("def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1",
     "returns the wrong average", "return the wrong average"),
    ("def last_item(items):\n    return items[len(items)]", "crashes with an IndexError", "crash with an IndexError"),
    ("def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] += 1\n    return counts",
     "raises a KeyError", "raise a KeyError"),
    ("function isEven(n) {\n  return n % 2 == 1;\n}", "gives the opposite answer", "give the opposite answer"),
    ("def add_item(item, basket=[]):\n    basket.append(item)\n    return basket",
     "keeps items from earlier calls", "keep items from earlier calls"),
    ("for i in range(1, 10):\n    if i % 3 == 0:\n        print(i, 'is divisible by three')\n    else\n        print(i)",
     "does not run at all", "not run at all"),
    ("def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)",
     "always returns zero", "always return zero"),
    ("let total = 0;\nfor (let i = 0; i <= prices.length; i++) {\n  total += prices[i];\n}",
     "ends up with NaN", "end up with NaN"),
    ("SELECT name, COUNT(*) FROM orders;", "fails on most databases", "fail on most databases"),
    ("def is_sorted(xs):\n    for i in range(len(xs)):\n        if xs[i] > xs[i + 1]:\n            return False\n    return True",
     "crashes on the last element", "crash on the last element"),
    ("def greet(name):\n    print('Hello, ' + name + '!')\n\nmessage = greet('Ada')\nprint(message.upper())",
     "raises an AttributeError", "raise an AttributeError"),
    ("while count < 10:\n    print(count)", "never stops", "never stop"),
]
BUG_TEMPLATES = [
    "This code {why}. Find the bug and fix it:\n\n{code}",
    "Why does this snippet {why_bare}? Explain the problem and show a corrected version.\n\n{code}",
    "Review this code and fix the mistake (it {why}):\n\n{code}",
]
SQL_TASKS = [
    "lists the ten customers who spent the most last year, from tables customers(id, name) and orders(customer_id, amount, created_at)",
    "counts the employees in each department, from a table employees(id, name, department)",
    "finds products that have never been ordered, from tables products(id, name) and order_items(product_id, quantity)",
    "returns the average rating per film, only for films with at least five ratings, from ratings(film_id, stars)",
    "finds duplicate email addresses in a users(id, email) table",
    "shows monthly revenue for 2025 from payments(amount, paid_at)",
    "lists students who passed every exam, from results(student_id, exam_id, score) with 50 as the pass mark",
    "returns the latest order of each customer from orders(id, customer_id, created_at)",
]


def _coding(topic: tuple, rng: random.Random) -> list[list[str]]:
    kind, payload = topic
    if kind == "spec":
        langs = rng.sample(sorted(set(LANGUAGES)), 3) + ["Python"]
        return [[t.format(l=lang, t=payload)] for t in CODE_TEMPLATES for lang in langs]
    if kind == "bug":
        code, why, bare = payload
        return [[t.format(code=code, why=why, why_bare=bare)] for t in BUG_TEMPLATES]
    return [[f"Write an SQL query that {payload}."], [f"How would I write a SQL query that {payload}? Explain each clause."]]


CODE_TOPICS = [("spec", s) for s in CODE_SPECS] + [("bug", b) for b in BUGGY_SNIPPETS] + [("sql", q) for q in SQL_TASKS]

# --------------------------------------------------------------------------------------------------------
# Maths word problems: each topic is a problem template with its own number ranges.


def _m_change(r):
    p, n = r.choice([35, 45, 60, 75, 80, 95, 120]), r.randint(3, 12)
    bill = next(b for b in (5, 10, 20, 50, 100) if b * 100 > p * n)
    return f"Pencils cost {p} cents each. Maya buys {n} of them and pays with a {bill}-dollar note. How much change does she get?"


def _m_speed(r):
    h, v = r.randint(2, 6), r.choice([45, 60, 72, 80, 90, 110])
    return (f"A train covers {h * v} km in {h} hours. What is its average speed? At the same speed, how far would it go "
            f"in {r.randint(2, 9)} hours and {r.choice([15, 30, 45])} minutes?")


def _m_recipe(r):
    s, t = r.choice([2, 4, 6]), r.choice([3, 5, 9, 10, 12, 15])
    return f"A recipe uses {r.choice([150, 200, 250, 300, 360])} g of flour for {s} servings. How much flour is needed for {t} servings?"


def _m_rectangle(r):
    w, k = r.randint(3, 20), r.randint(1, 9)
    return f"A rectangle's length is {k} cm more than its width, and its perimeter is {2 * (2 * w + k)} cm. What is its area?"


def _m_ages(r):
    a, b, c = r.randint(5, 40), r.randint(2, 15), r.randint(3, 20)
    return f"Leo is {a} years old and his sister is {b} years older. What will the sum of their ages be in {c} years?"


def _m_discount(r):
    return (f"A coat costs ${r.choice([40, 60, 85, 120, 150, 199])}. It is reduced by {r.choice([10, 15, 20, 25, 30, 40])}%, "
            f"then {r.choice([5, 7, 8, 10, 20])}% sales tax is added. What is the final price?")


def _m_workers(r):
    n, h = r.randint(2, 8), r.randint(3, 12)
    m = r.choice([x for x in range(2, 13) if x != n])
    return f"{n} painters can paint a fence in {h} hours. How long would {m} painters take, working at the same rate?"


def _m_tank(r):
    v, fill = r.choice([120, 200, 300, 450, 600]), r.randint(8, 30)
    return (f"A {v}-litre tank is empty. A pipe fills it at {fill} litres per minute, but a leak drains "
            f"{r.randint(1, fill - 2)} litres per minute. How long until the tank is full?")


def _m_interest(r):
    p, rate, y = r.choice([500, 1000, 2500, 4000, 10000]), r.choice([2, 3, 4, 5, 6]), r.randint(2, 10)
    kind = r.choice(["simple interest", "interest compounded once a year"])
    return f"You deposit ${p} at {rate}% {kind}. How much money is in the account after {y} years?"


def _m_class(r):
    n, p = r.choice([20, 24, 25, 30, 32, 40]), r.choice([25, 50, 75])
    return (f"A class has {n} students. {p}% of them walk to school and half of the others come by bus. "
            f"How many students come by bus, and how many arrive some other way?")


def _m_average(r):
    k, a, x = r.randint(4, 12), r.randint(50, 90), r.randint(30, 100)
    return f"The average of {k} test scores is {a}. A new score of {x} is added. What is the new average?"


def _m_marbles(r):
    red, blue, green = r.randint(2, 12), r.randint(2, 12), r.randint(1, 10)
    return (f"A bag holds {red} red, {blue} blue and {green} green marbles. You draw one at random. What is the probability "
            f"that it is not {r.choice(['red', 'blue', 'green'])}?")


def _m_roundtrip(r):
    d, u, v = r.choice([6, 10, 12, 15, 20]), r.choice([8, 10, 12, 15]), r.choice([20, 24, 30, 36])
    return (f"A cyclist rides {d} km uphill at {u} km/h and comes back down the same road at {v} km/h. "
            f"What is the average speed for the whole trip?")


def _m_phone(r):
    f, c, g = r.choice([10, 15, 20, 25]), r.choice([2, 3, 4, 5]), r.choice([5, 10, 15])
    return (f"A phone plan costs ${f} a month and includes {g} GB of data; each extra gigabyte costs ${c}. "
            f"Sam used {g + r.randint(1, 9)} GB last month. What was the bill?")


def _m_unitprice(r):
    a, b = r.randint(2, 6), r.choice([3, 4.5, 5, 6, 7.5, 9])
    return f"{a} notebooks cost ${b:.2f}. How many notebooks can you buy with ${r.choice([20, 25, 30, 40, 50])}?"


def _m_path(r):
    w, length, p = r.randint(4, 15), r.randint(6, 25), r.choice([1, 1.5, 2])
    return f"A garden measures {w} m by {length} m. A path {p} m wide runs around the outside of it. What is the area of the path?"


def _m_sequence(r):
    a, d, n = r.randint(1, 20), r.randint(2, 9), r.randint(10, 40)
    return f"A sequence starts at {a} and each term is {d} more than the one before. What is term number {n}, and what is the sum of the first {n} terms?"


def _m_clock(r):
    h, m = r.randint(1, 11), r.choice([0, 10, 15, 20, 30, 40, 45, 50])
    return f"What is the smaller angle between the hour hand and the minute hand of a clock at {h}:{m:02d}?"


MATH_TOPICS = [_m_change, _m_speed, _m_recipe, _m_rectangle, _m_ages, _m_discount, _m_workers, _m_tank, _m_interest,
               _m_class, _m_average, _m_marbles, _m_roundtrip, _m_phone, _m_unitprice, _m_path, _m_sequence, _m_clock]
MATH_SUFFIXES = ["", " Show your working.", " Explain each step briefly.", " Give the answer first, then the reasoning."]


def _math(topic: Callable, rng: random.Random) -> list[list[str]]:
    return [[topic(rng) + rng.choice(MATH_SUFFIXES)] for _ in range(24)]


# --------------------------------------------------------------------------------------------------------
# Creative writing

FORMS = ["a haiku", "a short poem", "a limerick", "a four-line rhyming poem", "a short story of about 150 words",
         "the opening paragraph of a mystery story", "a fable with a clear moral", "a short dialogue between two characters",
         "a diary entry", "a bedtime story for a small child", "the chorus of a folk song", "a postcard message"]
SUBJECTS = [
    "a lighthouse keeper on her last night of work", "a robot learning to bake bread", "the first snow of winter",
    "an umbrella left behind on a bus", "a cat who believes it owns the house", "an old map found inside a library book",
    "a city at four in the morning", "a friendship between a crow and a scarecrow", "the last day of the summer holidays",
    "a night train with only one passenger", "a tiny dragon living in a teapot", "a grandmother's box of recipe cards",
    "a runner at the twentieth mile of a marathon", "a garden the morning after a storm", "a village where it always rains",
    "the cook on a long space voyage", "a birthday everyone forgot", "a violin played in an empty hall",
    "a detective who is afraid of the dark", "a tree that remembers everyone who climbed it", "a snail entering a race",
    "two strangers sharing a park bench", "a key that opens every door but one", "moving to a new country",
    "the smell of a bakery at dawn", "a clock that runs backwards", "a fisherman who catches a message in a bottle",
    "a lost hiking boot", "the quiet after a thunderstorm", "a shy ghost in a busy hotel", "a street musician's best day",
    "a child's first day at school", "a kite that escaped", "an astronaut looking back at Earth", "a bookshop cat",
    "a bridge between two rival towns", "a lonely vending machine", "the first cup of coffee of the day",
    "a river seen through the seasons", "a letter delivered fifty years late", "an octopus who collects buttons",
    "a windmill on a hill", "an orchestra tuning up", "the end of a long friendship and the start of a new one",
]
CREATIVE_EXTRAS = ["", " Keep it under 100 words.", " Give it a hopeful ending.", " Write it in the first person.",
                   " Make it gently funny.", " End with an unexpected twist."]
CREATIVE_TEMPLATES = ["Write {f} about {s}.{x}", "Could you write {f} about {s}?{x}", "Compose {f} inspired by {s}.{x}"]


def _creative(topic: str, rng: random.Random) -> list[list[str]]:
    forms = rng.sample(FORMS, 6)
    return [[rng.choice(CREATIVE_TEMPLATES).format(f=f, s=topic, x=rng.choice(CREATIVE_EXTRAS))] for f in forms]


# --------------------------------------------------------------------------------------------------------
# Rewriting and editing

PASSAGES_SHORT = [
    "hey, the meeting is moved to thursday cause half the team is out, pls update ur calendars",
    "Their going to announce the results tomorow, but nobody know exactly what time.",
    "The report was written by the intern and it was reviewed by the manager and then it was sent to the client.",
    "We regret to inform you that your application has not been successful on this occasion.",
    "I think maybe we should possibly consider perhaps changing the supplier at some point.",
    "Our new app helps you track your habits, set reminders and see your progress over time.",
    "The printer on the third floor is broken again, please use the one near the kitchen until it is fixed.",
    "Customers who bought the blue kettle between March and May may return it for a full refund.",
    "Me and him was going to the shop when it started raining really hard.",
    "The museum will be closed for renovation from the first of June until the end of August.",
    "In my opinion, I personally believe that the plan is a good plan that we should follow.",
    "Due to unforeseen circumstances beyond our control, the event has been postponed indefinitely.",
    "The dog ran across the field, it jumped over the fence, it chased the ball.",
    "Please be advised that the parking lot will be repainted this weekend and cars must be moved.",
    "If you have any questions dont hesitate to reach out to me at any time.",
    "The experiment failed because the samples was contaminated before the measurement.",
    "Our team delivered the project two weeks early and under budget.",
    "You need to submit your timesheet by Friday or you won't get paid on time.",
    "The library have extended its opening hours during the exam period.",
    "Thanks so much for the lovely dinner last night, we had an amazing time!",
    "The software update makes the battery last longer and fixes the bug with notifications.",
    "It is important to note that the results may vary depending on a number of different factors.",
    "Rain is expected in the afternoon, so bring an umbrella if you are going out.",
    "I am writing to complain about the noise coming from the flat upstairs every night after midnight.",
    "Everyone must wear a helmet on the building site, no exceptions.",
    "The cafe on the corner sells the best cinnamon buns in town, according to my neighbour.",
    "We are excited to welcome three new members to the design team this month.",
    "Your order has been shipped and should arrive within three to five working days.",
    "She dont like when people interrupts her during presentations.",
    "The bridge will be closed to traffic overnight while engineers inspect the cables.",
    "Kindly revert back to me at your earliest convenience regarding the aforementioned matter.",
    "Water the plants twice a week and keep them away from direct afternoon sun.",
]
REWRITE_INSTRUCTIONS = [
    "Rewrite this in a more formal tone:", "Make this sound friendlier:", "Fix the grammar and spelling in this text:",
    "Rewrite this so a ten-year-old could understand it:", "Make this more concise:", "Rewrite this in the active voice:",
    "Turn this into a polite request:", "Rewrite this so it sounds more confident:", "Improve the clarity of this text:",
    "Rewrite this as a short, upbeat social media post:", "Rewrite this in plain English, removing the jargon:",
]


def _rewrite(topic: str, rng: random.Random) -> list[list[str]]:
    return [[f'{ins}\n\n"{topic}"'] for ins in REWRITE_INSTRUCTIONS]


# --------------------------------------------------------------------------------------------------------
# Summarisation

PASSAGES_LONG = [
    "The town council voted on Tuesday to turn the old bus depot into a covered market. The building has stood empty for "
    "six years. Traders will be able to rent stalls from next spring, and the council expects around forty stalls. "
    "Some residents worry about traffic, so a new cycle rack and a loading bay will be added.",
    "Researchers at a coastal university tracked two hundred seagulls with small GPS tags for a year. They found that "
    "the birds travelled up to eighty kilometres a day to reach landfill sites, especially in winter. Gulls that nested "
    "near fishing harbours travelled much less. The team says the findings could help towns plan waste collection.",
    "Our company will move to a four-day working week for a six-month trial starting in January. Staff will work the "
    "same number of hours over four days, and customer support will be covered on a rota. Managers will measure "
    "productivity and wellbeing before deciding whether to keep the new schedule.",
    "The new Lumo desk lamp adjusts its brightness to the light in the room and turns warmer in the evening. It folds "
    "flat for travel and charges over USB-C. A full charge lasts about twelve hours. It goes on sale next month in three colours.",
    "Tea reached Britain in the seventeenth century, when it was an expensive drink for the wealthy. High taxes led to "
    "widespread smuggling until the tax was cut sharply in 1784. After that, tea became cheap enough for ordinary "
    "households, and it soon became part of daily life across the country.",
    "Minutes of the garden club meeting: membership has grown to 58. The spring plant sale raised 640 pounds, which will "
    "pay for a new shed. Volunteers are needed to water the community beds in August. The next meeting is on 4 September.",
    "Sleep researchers asked volunteers to keep their phones outside the bedroom for two weeks. Most reported falling "
    "asleep faster and feeling more rested, although a few found it hard to wake without their phone alarm. The "
    "researchers caution that the study was small and did not include a control group.",
    "A small bakery in the harbour district has started selling yesterday's bread at half price in the late afternoon. "
    "The owner says it has cut waste by a third and brought in new customers. Other shops on the street are now "
    "considering similar offers for fruit and flowers.",
    "The hiking trail along the northern ridge will reopen on Saturday after repairs to two footbridges damaged in the "
    "spring floods. Walkers are asked to stay on the marked path, as some slopes remain unstable. The car park at the "
    "start of the trail will charge a small fee to fund further maintenance.",
    "Volcanic eruptions can cool the planet for a year or two. Large eruptions throw sulphur gas high into the "
    "atmosphere, where it forms tiny droplets that reflect sunlight. The effect fades as the droplets fall back to "
    "earth, which is why the cooling does not last.",
    "The school will introduce a new reading programme next term. Each class will have twenty minutes of quiet reading "
    "every morning, and pupils can choose their own books from a refreshed library. Parents are invited to donate "
    "books in good condition at the front office.",
    "Our internet provider will carry out maintenance on Sunday between 2 a.m. and 5 a.m. During this time, "
    "connections may drop for a few minutes at a time. No action is needed, but customers should restart their "
    "router if problems continue after 6 a.m.",
    "A regional orchestra has started playing short concerts in hospital waiting rooms. The musicians play for thirty "
    "minutes, choosing calm pieces. Staff say patients seem less anxious, and the orchestra hopes to visit three more "
    "hospitals next year if funding allows.",
    "Electric scooters will be available to rent in the city centre from May. Riders must be over eighteen and hold a "
    "driving licence. Scooters will be limited to twenty kilometres per hour and cannot be parked on narrow pavements. "
    "The scheme will be reviewed after one year.",
    "Honey found in ancient tombs has been reported to be still edible. Honey keeps for a very long time because it "
    "contains little water and is slightly acidic, which stops most bacteria from growing. Bees also add an enzyme "
    "that produces small amounts of hydrogen peroxide.",
    "The annual staff survey shows that 72 percent of employees are happy with their team, up from 65 percent last "
    "year. However, fewer than half feel they have clear paths for promotion. Human resources will hold workshops on "
    "career planning in the autumn.",
    "A farmer in the valley has planted wildflower strips between his fields. Within two summers, the number of bees "
    "and butterflies on his land roughly doubled. He says his crops have not suffered, and neighbouring farms have "
    "asked for advice on doing the same.",
    "The city's main library is launching a tool-lending service. Members will be able to borrow drills, ladders and "
    "sewing machines for up to a week, free of charge. The tools were donated by local businesses, and staff will "
    "check each item when it is returned.",
    "Engineers have finished testing a new flood barrier on the river. The barrier rises automatically when the water "
    "reaches a set level and can protect about two thousand homes. It cost less than expected because it reuses the "
    "foundations of an older wall.",
    "Customers have reported that the latest version of our photo app crashes when exporting large albums. The "
    "development team has found the cause, a memory problem in the export step, and a fix will be released on Thursday. "
    "Until then, users can export albums in smaller batches.",
    "The mountain village has held a cheese festival every October for over a century. Farmers bring wheels of cheese "
    "down from the summer pastures, and visitors can taste dozens of varieties. This year, organisers expect a record "
    "crowd and have added a shuttle bus from the nearest train station.",
    "Learning a musical instrument as an adult is slower than in childhood, but many adults make steady progress by "
    "practising a little every day. Teachers recommend short, focused sessions and recording yourself to notice "
    "mistakes. Playing with others also helps keep motivation high.",
    "The ferry company has announced a new winter timetable. Crossings will run every ninety minutes instead of every "
    "hour, and the last evening departure will be at 9 p.m. Tickets bought before the change will still be valid on "
    "any crossing on the same day.",
    "A study of office workers found that those who took a short walk after lunch reported better concentration in "
    "the afternoon than those who stayed at their desks. The walks lasted about fifteen minutes. The researchers now "
    "plan a larger study over a full year.",
    "Our neighbourhood repair café meets on the first Saturday of every month. Volunteers help people fix lamps, "
    "toasters, clothes and bicycles instead of throwing them away. Last year they repaired more than three hundred "
    "items, and they are looking for someone who can mend shoes.",
    "The art gallery will extend its opening hours on Friday evenings during the summer. Entry after 6 p.m. will be "
    "free, and there will be short talks about selected paintings. The gallery hopes the change will attract younger "
    "visitors and people who work during the day.",
    "Octopuses can change the colour and texture of their skin in a fraction of a second. They do this with thousands "
    "of tiny sacs of pigment controlled by muscles. They use the ability to hide from predators, to sneak up on prey "
    "and possibly to signal to other octopuses.",
    "The company's quarterly results show sales up eight percent, driven by strong demand for its garden furniture. "
    "Costs also rose because of higher shipping prices, so profit grew only slightly. The board expects a quieter "
    "winter and will delay the opening of a new warehouse.",
    "A new rule requires all new buildings in the district to include space for bicycle storage. Developers must "
    "provide at least one secure space per flat. Supporters say it will encourage cycling; critics worry it will make "
    "small flats more expensive to build.",
    "The community swimming pool reopened after a year of renovation. It now has a separate shallow pool for young "
    "children, new changing rooms and solar panels on the roof that heat the water. Opening hours have been extended "
    "to 10 p.m. on weekdays.",
]
SUMMARY_INSTRUCTIONS = [
    "Summarise the following passage in one sentence.", "Give a two-bullet summary of this text.",
    "What is the main point of this passage?", "Write a short headline for this passage.",
    "Summarise this for a busy reader in under thirty words.", "List the three most important facts in this passage.",
    "Explain what this passage says to someone who only has ten seconds.",
    "Summarise the passage, then name one question it leaves unanswered.",
]


def _summary(topic: str, rng: random.Random) -> list[list[str]]:
    return [[f"{ins}\n\n{topic}"] for ins in SUMMARY_INSTRUCTIONS]


# --------------------------------------------------------------------------------------------------------
# Classification and extraction

PRODUCTS = ["pair of wireless earbuds", "rice cooker", "pair of hiking boots", "desk chair", "e-reader", "blender",
            "backpack", "phone case", "coffee grinder", "yoga mat", "board game", "winter jacket", "smartwatch",
            "kitchen knife", "tent", "vacuum cleaner"]
PRAISE = ["works perfectly", "feels really well made", "arrived a day early", "is worth every penny",
          "exceeded my expectations", "is so easy to use"]
COMPLAINTS = ["broke after two weeks", "is much smaller than the photos suggest", "smells strongly of plastic",
              "stopped charging after a month", "came with a missing part", "is far too noisy"]
HEADLINES = [
    "Local team wins regional final after dramatic penalty shootout", "Parliament debates new rules on rental deposits",
    "Start-up unveils battery that charges in five minutes", "Study links daily walking to lower blood pressure",
    "Supermarket chain reports record profits despite rising costs", "Veteran goalkeeper announces retirement at 39",
    "City council approves new cycle lanes on main avenue", "Researchers train robot hand to fold laundry",
    "Flu vaccine uptake rises among older adults", "Shipping company orders twelve wind-assisted cargo ships",
    "Marathon record falls in cool conditions", "Minister resigns over budget dispute",
    "New app lets users compare the energy use of home appliances", "Doctors warn about heat stroke during summer festival",
    "Coffee prices climb after poor harvest", "Tennis star returns from injury with straight-sets win",
]
CUSTOMER_MESSAGES = [
    "I've been charged twice for the same order, can someone sort this out?",
    "Do you deliver to the islands, and how long does it take?", "Your staff at the downtown store were wonderful today.",
    "The package arrived soaking wet and the book inside is ruined.", "Can I change the size of my order before it ships?",
    "Just wanted to say the new menu is fantastic!", "Why is my account locked? I didn't do anything.",
    "Is the blue version coming back in stock?", "The driver left my parcel in the rain again.",
    "Thanks for fixing my laptop so quickly.", "How do I cancel my subscription?",
    "I waited forty minutes on the phone and nobody answered.",
]
PEOPLE = ["Amira Haddad", "Jonas Berg", "Priya Nair", "Tomás Ruiz", "Chen Wei", "Grace Okafor", "Lukas Novak",
          "Sofia Rossi", "Daniel Kim", "Elena Petrova"]
PLACES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Melbourne", "Santiago", "Edinburgh", "Hanoi", "Lyon"]
EVENTS = ["sign the partnership agreement", "review the spring budget", "plan the product launch", "interview candidates",
          "open the new office", "present the research results", "discuss the merger", "record the podcast"]
ITEM_POOLS = {
    "fruits, vegetables or grains": ["apple", "carrot", "barley", "mango", "spinach", "oats", "pear", "broccoli",
                                     "rice", "plum", "leek", "quinoa", "cherry", "cabbage"],
    "mammals, birds, reptiles or fish": ["dolphin", "sparrow", "gecko", "salmon", "bat", "penguin", "tortoise",
                                         "tuna", "otter", "eagle", "iguana", "cod", "whale", "owl"],
    "renewable or non-renewable energy sources": ["wind", "coal", "solar", "natural gas", "hydropower", "oil",
                                                  "geothermal", "peat", "tidal", "uranium"],
    "countries or cities": ["Peru", "Vienna", "Kenya", "Mumbai", "Norway", "Cairo", "Chile", "Seoul", "Ghana", "Quebec City"],
}


def _classification(topic: tuple, rng: random.Random) -> list[list[str]]:
    kind, payload = topic
    if kind == "review":
        out = []
        for _ in range(6):
            good, bad = rng.choice(PRAISE), rng.choice(COMPLAINTS)
            text = rng.choice([f"This {payload} {good}.", f"Honestly, this {payload} {bad}.",
                               f"The {payload} {good}, but it {bad}.", f"I returned the {payload} because it {bad}."])
            out.append([rng.choice([
                f"Classify the sentiment of this review as positive, negative or mixed: \"{text}\"",
                f"Is this customer review positive, negative or mixed? Answer with one word, then explain.\n\n{text}",
                f"Read the review and say what the customer liked and disliked: \"{text}\"",
            ])])
        return out
    if kind == "headline":
        return [[f"Which section of a newspaper does this headline belong to: sports, politics, technology, health or "
                 f"business?\n\n\"{payload}\""], [f"Label the topic of this headline in one word: {payload}"]]
    if kind == "message":
        return [[f"Is this customer message a complaint, a question or a compliment? \"{payload}\""],
                [f"Classify the intent of this support message and suggest who should handle it: \"{payload}\""]]
    if kind == "entities":
        out = []
        for _ in range(5):
            a, b = rng.sample(PEOPLE, 2)
            day, month = rng.randint(1, 28), rng.choice(["March", "April", "June", "September", "November"])
            sentence = f"{a} will meet {b} in {payload} on {day} {month} to {rng.choice(EVENTS)}."
            out.append([rng.choice([
                f"Extract the people, the place and the date from this sentence, as JSON: {sentence}",
                f"Who is meeting whom, where and when? Answer as a short list.\n\n{sentence}",
            ])])
        return out
    pool = ITEM_POOLS[payload]
    out = []
    for _ in range(5):
        items = ", ".join(rng.sample(pool, rng.randint(5, 7)))
        out.append([rng.choice([f"Sort these into {payload}: {items}.",
                                f"Group the following items as {payload}, and say how you decided: {items}."])])
    return out


CLASSIFY_TOPICS = ([("review", p) for p in PRODUCTS] + [("headline", h) for h in HEADLINES]
                   + [("message", m) for m in CUSTOMER_MESSAGES] + [("entities", p) for p in PLACES]
                   + [("items", k) for k in ITEM_POOLS])

# --------------------------------------------------------------------------------------------------------
# Advice

SITUATIONS = [
    "I just started a new job and feel overwhelmed by how much there is to learn",
    "My flatmate keeps leaving dirty dishes in the sink", "I want to move from accounting into software development",
    "I have two job offers and cannot decide between them", "I keep putting off big projects until the last minute",
    "My best friend forgot my birthday and I feel hurt", "I want to ask my manager for a raise",
    "I get very nervous when I have to speak in meetings", "I moved to a new city and don't know anyone",
    "My teenager spends all evening on their phone", "I want to start exercising but always give up after a week",
    "A colleague keeps taking credit for my work", "I have some savings and don't know whether to pay off debt or invest",
    "I am thinking about going back to university at forty", "My neighbour's dog barks all day while they are at work",
    "I feel tired all the time even though I sleep eight hours", "I said something rude to a friend and regret it",
    "My small online shop gets visitors but almost no sales", "I want to learn to cook but I only have a tiny kitchen",
    "I have been offered a promotion that means managing my former peers", "I can't stop checking work email at night",
    "I want to travel alone for the first time", "My parents want me to study medicine but I love design",
    "I am about to adopt my first cat", "I keep losing motivation to practise the piano",
    "My team missed an important deadline and the client is upset", "I want to reduce the amount of meat I eat",
    "I find it hard to say no when people ask me for favours", "I am choosing between renting in the centre or buying in the suburbs",
    "I have a job interview tomorrow for a role I really want", "My grandmother is moving in with us next month",
    "I want to start a podcast with a friend", "I feel lonely working from home every day",
    "I was rejected from my dream job", "My garden gets almost no sun and nothing grows",
    "I am planning a wedding on a small budget", "I want to get better at remembering people's names",
    "My coworker talks loudly on the phone all day", "I am retiring next year and worry about being bored",
    "I want to quit sugar in my coffee",
]
ADVICE_TEMPLATES = ["{s}. What should I do?", "{s}. Any advice?", "I could use some advice. {s}. How should I handle it?",
                    "{s}. What are my options, and which would you recommend?", "{s}. What would you do in my place?"]


def _advice(topic: str, rng: random.Random) -> list[list[str]]:
    return [[t.format(s=topic)] for t in ADVICE_TEMPLATES]


# --------------------------------------------------------------------------------------------------------
# Brainstorming

IDEA_THINGS = [
    "rainy-day activities with young children", "names for a neighbourhood bakery", "a school science fair project",
    "a team-building event that doesn't feel forced", "cheap evenings out with a partner", "a small gift for a colleague who is leaving",
    "blog posts about balcony gardening", "ways to reduce paper waste in an office", "a theme for a 30th birthday party",
    "healthy snacks to take on a long hike", "uses for leftover rice", "questions to ask at the end of a job interview",
    "a short story set on a submarine", "fundraising ideas for a local football club", "ways to welcome new neighbours",
    "weekend projects to learn electronics", "games to play on a long car journey", "ways to make a small flat feel bigger",
    "a name for a pet tortoise", "topics for a ten-minute talk at a book club", "ways to practise a foreign language every day",
    "activities for a family reunion", "a logo concept for a bicycle repair shop", "ways to save water at home",
    "fun ways to teach fractions", "things to do in a city when it is raining", "low-cost hobbies for retirement",
    "mobile app ideas for students", "ways to keep a remote team connected", "decorations for a spring fete",
    "a menu for a picnic", "ideas for a community mural", "slogans for a recycling campaign",
    "ways to celebrate a friend's promotion", "quick breakfasts for busy mornings", "podcast episode ideas about local history",
]
IDEA_TEMPLATES = ["Give me {n} ideas for {t}.", "Brainstorm {n} {t}.", "I need inspiration: list {n} suggestions for {t}.",
                  "What are {n} creative options for {t}? One line each."]


def _ideas(topic: str, rng: random.Random) -> list[list[str]]:
    return [[t.format(n=n, t=topic)] for t in IDEA_TEMPLATES for n in rng.sample(["three", "five", "seven", "ten"], 2)]


# --------------------------------------------------------------------------------------------------------
# Comparisons

PAIRS = [
    ("a virus", "a bacterium"), ("stocks", "bonds"), ("RAM", "disk storage"), ("a crocodile", "an alligator"),
    ("baking soda", "baking powder"), ("a simile", "a metaphor"), ("speed", "velocity"), ("a latte", "a cappuccino"),
    ("TCP", "UDP"), ("renting a home", "buying one"), ("a debit card", "a credit card"), ("a sea", "an ocean"),
    ("Python lists", "Python tuples"), ("mass", "weight"), ("a hurricane", "a tornado"), ("an LED bulb", "a halogen bulb"),
    ("a will", "a trust"), ("affect", "effect"), ("a cold", "the flu"), ("butter", "margarine"), ("a lake", "a pond"),
    ("a moth", "a butterfly"), ("an orchestra", "a band"), ("a CV", "a cover letter"), ("weathering", "erosion"),
    ("a psychologist", "a psychiatrist"), ("a router", "a modem"), ("a loan", "a lease"), ("a novel", "a novella"),
    ("static typing", "dynamic typing"), ("a comet", "an asteroid"), ("frost", "dew"), ("a rabbit", "a hare"),
    ("git merge", "git rebase"), ("a sprint", "a marathon"), ("an embassy", "a consulate"),
]
COMPARE_TEMPLATES = [
    "What's the difference between {a} and {b}?", "Compare {a} with {b}: two similarities and two differences.",
    "People often mix up {a} and {b}. How can I tell them apart?", "Explain {a} versus {b} in a small table.",
    "In a few sentences, how do {a} and {b} differ?",
]


def _compare(topic: tuple, rng: random.Random) -> list[list[str]]:
    a, b = topic
    return [[t.format(a=a, b=b)] for t in COMPARE_TEMPLATES]


# --------------------------------------------------------------------------------------------------------
# Practical writing (emails, notes)

SCENARIOS = [
    "to my landlord asking for the broken heater to be repaired", "to a colleague asking to swap shifts next Tuesday",
    "to my child's teacher explaining an absence", "to a customer apologising for a late delivery",
    "to my team announcing a new weekly check-in", "to a hotel asking for a late check-out",
    "to a neighbour about a parcel I took in for them", "to a client confirming tomorrow's meeting time",
    "to my manager asking to work from home on Fridays", "to a supplier asking for an updated price list",
    "to a friend declining a wedding invitation kindly", "to a recruiter following up after an interview",
    "to the council reporting a broken street light", "to a gym cancelling my membership",
    "to new volunteers welcoming them to the food bank", "to a professor asking for an extension on an essay",
    "to a plumber asking for a quote", "to my book club suggesting next month's book",
    "to a company asking about internship opportunities", "to colleagues inviting them to a farewell lunch",
    "to a restaurant asking whether they can cater for a nut allergy", "to a tenant reminding them about rent due next week",
    "to a mentor thanking them for their help this year", "to parents announcing the school trip details",
    "to a seller asking whether a used bike is still available", "to my bank asking why a payment was declined",
    "to a conference organiser requesting a vegetarian meal", "to a coworker giving feedback on their draft",
]
EMAIL_TEMPLATES = ["Write a short email {s}.", "Draft a polite message {s}.",
                   "Help me write a brief note {s}; keep it friendly but professional.",
                   "Write two versions of a message {s}: one formal and one casual.",
                   "I need to send a message {s}. Can you write it in under eighty words?",
                   "Write a clear, warm email {s}, with a subject line."]


def _email(topic: str, rng: random.Random) -> list[list[str]]:
    return [[t.format(s=topic)] for t in EMAIL_TEMPLATES]


# --------------------------------------------------------------------------------------------------------
# Multi-turn follow-ups: an opening question, then a follow-up that depends on the answer.

OPENERS = [
    "I'm thinking about learning the guitar as an adult. Where should I start?",
    "What are the main things to consider when choosing a laptop for university?",
    "Can you suggest a simple weekly workout plan for someone who sits at a desk all day?",
    "How does a sourdough starter work?", "What should I pack for a week of hiking in the mountains?",
    "Give me a basic plan for learning Spanish in six months.", "How do electric cars differ from petrol cars to maintain?",
    "Suggest a menu for a relaxed dinner with friends.", "What is a good way to organise notes for a research project?",
    "How do I get started with birdwatching?", "What makes a good team leader?",
    "Explain how a credit card statement is structured.", "What are the pros and cons of working from home?",
    "How can a small café attract more customers?", "What are some good habits for keeping a tidy home?",
    "Outline a short talk about why sleep matters.", "How should I prepare my garden for spring?",
    "What should a beginner know about investing in index funds?", "How do I write a good README for a small project?",
    "What are some ways to make a long flight more comfortable?", "Describe how to plan a small community event.",
    "What is the best way to learn to touch-type code?", "How can I make my presentations more engaging?",
    "What are the basics of caring for a rescue dog?", "Suggest a reading list to get into science fiction.",
    "How should I start saving for retirement in my twenties?", "What's a sensible routine for the week before an exam?",
    "How do I set up a simple home network securely?", "What are the steps to writing a short story?",
    "How can a family cut its energy bill?", "What are good first projects for learning to program?",
    "How do I make a cheap but healthy lunch for work?", "Plan a one-day visit to a city I have never been to.",
    "How do I choose a good running shoe?", "What should I look for when renting my first flat?",
    "How can I become a more patient listener?",
]
FOLLOW_UPS = [
    "Can you make that shorter?", "Now give me a concrete example.", "Turn your answer into a checklist.",
    "Which of those points matters most, and why?", "What would you say to someone who disagrees?",
    "Summarise your answer in one sentence.", "Explain it again for a complete beginner.",
    "What are the most common mistakes people make here?", "Turn that into a short quiz with three questions.",
    "What would change if I only had half the budget?", "Can you put that in a table?",
    "What should I do first, this week?",
]


def _followup(topic: str, rng: random.Random) -> list[list[str]]:
    return [[topic, f] for f in rng.sample(FOLLOW_UPS, 5)]


# --------------------------------------------------------------------------------------------------------
# Assembly

KINDS: dict[str, tuple[list, Callable[[object, random.Random], list[list[str]]]]] = {
    "explanation": (CONCEPTS, _explanation),
    "how-to": (TASKS, _howto),
    "coding": (CODE_TOPICS, _coding),
    "math": (MATH_TOPICS, _math),
    "creative-writing": (SUBJECTS, _creative),
    "rewriting": (PASSAGES_SHORT, _rewrite),
    "summarisation": (PASSAGES_LONG, _summary),
    "classification": (CLASSIFY_TOPICS, _classification),
    "advice": (SITUATIONS, _advice),
    "brainstorming": (IDEA_THINGS, _ideas),
    "comparison": (PAIRS, _compare),
    "practical-writing": (SCENARIOS, _email),
    "follow-up": (OPENERS, _followup),
}


def _round_robin(groups: list[list[list[str]]], limit: int, seen: set[str]) -> list[list[str]]:
    """Take prompts one topic at a time, so every topic is used before any is used twice; skip duplicates."""
    picked: list[list[str]] = []
    queues = [list(g) for g in groups]
    while len(picked) < limit and any(queues):
        for q in queues:
            while q:
                turns = q.pop()
                key = "\n\n".join(turns)
                if key not in seen:
                    seen.add(key)
                    picked.append(turns)
                    break
            if len(picked) >= limit:
                break
    return picked


def build_prompt_sets(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train, heldout) records, deterministic for a seed; held-out topics never appear in train."""
    rng = random.Random(seed)
    train, heldout_pool = [], {}
    seen: set[str] = set()
    for kind, (topics, render) in KINDS.items():
        order = list(range(len(topics)))
        rng.shuffle(order)
        n_held = max(2, round(HELDOUT_TOPIC_FRACTION * len(topics)))
        held_idx, train_idx = order[:n_held], order[n_held:]

        def groups(idx: list[int], render=render, topics=topics) -> list[list[list[str]]]:
            out = []
            for i in idx:
                variants = render(topics[i], rng)
                rng.shuffle(variants)
                out.append(variants)
            return out

        train += [{"prompt_id": f"{kind}-{n:04d}", "category": kind,
                   "messages": [{"role": "user", "content": t} for t in turns]}
                  for n, turns in enumerate(_round_robin(groups(train_idx), TRAIN_PER_KIND, seen))]
        heldout_pool[kind] = _round_robin(groups(held_idx), HELDOUT_TOTAL, seen)
    # An even share of the held-out budget per kind (the remainder to the first kinds).
    share, extra = divmod(HELDOUT_TOTAL, len(KINDS))
    heldout = []
    for k, (kind, pool) in enumerate(heldout_pool.items()):
        take = pool[: share + (k < extra)]
        heldout += [{"prompt_id": f"heldout-{kind}-{n:03d}", "category": kind,
                     "messages": [{"role": "user", "content": t} for t in turns]} for n, turns in enumerate(take)]
    return _interleave(train), _interleave(heldout)


def _interleave(records: list[dict]) -> list[dict]:
    """Kinds taken in turn (first of each kind, then second of each, ...), so any prefix (`limit=N`) is varied."""
    kinds = list(dict.fromkeys(r["category"] for r in records))
    rank: dict[str, int] = {}
    keyed = []
    for r in records:
        n = rank[r["category"]] = rank.get(r["category"], -1) + 1
        keyed.append(((n, kinds.index(r["category"])), r))
    return [r for _, r in sorted(keyed, key=lambda kr: kr[0])]


def _dump(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped prompt files (or, with --check, verify them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    train, heldout = build_prompt_sets()
    files = {EMBEDDED_TRAIN_PROMPTS: _dump(train), EMBEDDED_HELDOUT_PROMPTS: _dump(heldout)}
    if "--check" in argv:
        stale = [str(p) for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python -m specdec.train.prompt_set", file=sys.stderr)
            return 1
        print("embedded prompt files are up to date")
        return 0
    ASSETS.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(train)} train prompts to {EMBEDDED_TRAIN_PROMPTS} and {len(heldout)} held-out prompts "
          f"to {EMBEDDED_HELDOUT_PROMPTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
