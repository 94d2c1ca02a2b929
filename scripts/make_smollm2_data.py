"""Deterministic data for the SmolLM2-135M-Instruct campaigns (campaigns/smollm2*.yaml).

Writes, into campaigns/data/smollm2/ (this script lives in scripts/ because it imports the library, which the
bottom package `campaigns` may not):
  train-plural.jsonl    "Plural of <noun>?" prompts for the teacher (regular "+s" nouns, split by noun, seed 0)
  suite-plural.jsonl    120 held-out nouns: the task suite (exact match)
  train-general.jsonl   general questions asked to the teacher *bare* (teacher.context_categories: only
                        plural prompts get the few-shot context), so their labels are the base model's own
                        answers: replay that keeps the student's general behaviour
  suite-general.jsonl   the general-knowledge regression suite: questions the BASE model answers correctly
                        under four phrasings (bare, "Question: ...", "... Answer briefly.", "Please tell
                        me: ...": default system prompt, greedy, 32 new tokens, contains_answer); fixed
                        before any training. An item the base gets right only under one phrasing is a coin
                        flip, and any fine-tune flips some of those: a regression suite of them measures noise.

  facts-train.jsonl     "In which country is the city of <city>?" prompts (campaigns/smollm2_facts*.yaml): the
                        country's name as one capitalized word ("Argentina"), for cities the BASE model names the
                        country of in a sentence to that very prompt (default system prompt, greedy, 32 new
                        tokens, contains_answer); split by city
  facts-suite.jsonl     the held-out cities (about a third): the task suite (exact match)
                        (named facts-*, not train-*: campaigns/smollm2.yaml trains on train-*.jsonl)

General questions are split between suite and replay by ENTITY KEY (country, opposite pair, coloured
object, ...; sha256 of the key), so no suite entity appears in replay or in the teacher's context.

Only suite-general.jsonl and the facts files need the model (its outputs are cached in --cache, so a rerun is
instant and byte-identical); --only facts writes the facts files alone:

    .venv/bin/python scripts/make_smollm2_data.py [--cache DIR] [--threads 1] [--only facts]
"""

import argparse
import hashlib
import json
import os
import random
import re
import string


# ---------------------------------------------------------------- scorer
def squad_norm(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def contains_answer(pred, ref):
    p = squad_norm(pred).split()
    r = squad_norm(ref).split()
    if not r:
        return 0.0
    n = len(r)
    return 1.0 if any(p[i : i + n] == r for i in range(len(p) - n + 1)) else 0.0


# ---------------------------------------------------------------- plural nouns
NOUNS = """
cat dog book car tree house bird apple pen cup chair table door girl boy hat shoe bag ship lamp road river star flower
bottle window garden farmer teacher kitchen rock coin bell cloud hill horse cow duck frog key
desk ball egg sock rose bed
ant arm bean bear bike boat bone bowl brick bucket button cake camel candle card carpet castle chain cheek
coat comb cookie corner crown cushion diamond doctor doll dollar dragon dream drum eagle ear elephant engine eye
fan farm feather finger flag floor forest fork garage gate giant gift goat guitar hammer hand heart helmet hole hook
horn island jacket jar jewel kettle king kite ladder lake leg lemon letter lion lip lizard map market mirror monkey
moon mountain mug nail name needle nest net nose nurse ocean onion orange owl painter pan parrot pear pencil piano
picture pig pillow pilot pin planet plant plate player pocket pond poster prince puppet queen rabbit rat ring robot
rocket roof room rope ruler sailor school seed shark sheet shell shirt shop signal singer skirt snake
song spoon square squirrel stamp station stone storm street student sweater tail tent ticket tiger toe tower town
toy train truck tunnel turtle umbrella valley village violin wall wheel whale wing worm writer yard zebra
balloon banana basket blanket board bridge brother builder cabin camera canal carrot cart chicken cliff
clock collar computer cook cousin crab cricket dancer dentist drawer driver elbow field friend
frame game glove grape hamster handle hotel hunter insect jungle kangaroo kitten lamb lantern leopard
lock magnet meal melon message minute model monster motor muscle mushroom napkin neighbor number
oven paddle page panda parent path peanut pebble penguin pepper pet pirate pizza poem
pump puzzle quilt raven ribbon rug saddle scarf scooter seat shadow shovel
sister skate sled slipper snail soldier spider sponge stair stick stool sticker tablet
tank taxi thumb toaster toilet tool towel trail trumpet tulip uncle vase wagon wallet weapon
wizard yogurt
""".split()
# irregular / ambiguous plurals (not plain "+s") or nouns the model treats as mass nouns -> dropped
DROP_NOUNS = {
    "scarf",  # scarves
    "cliff",
    "roof",  # f-ending: reference "+s" is right but teacher/model waver (cliffs/cleves, rooves)
    "yogurt",  # mass noun
    "fish",
    "sheep",
    "deer",
}
NOUNS = sorted(
    set(w for w in NOUNS if w.isalpha() and w not in DROP_NOUNS and not re.search(r"(s|x|z|ch|sh|[^aeiou]y|fe)$", w))
)
PLURAL_DEMO = ["desk", "ball", "egg", "sock", "bed"]  # used only inside the teacher context


def plural_prompt(n):
    return f"Plural of {n}?"


def plural_answer(n):
    return n + "s"


def plural_split(seed=0, n_test=120):
    pool = [w for w in NOUNS if w not in PLURAL_DEMO and w != "rose"]
    r = random.Random(seed)
    r.shuffle(pool)
    return pool[n_test:], pool[:n_test]  # train, test


# ---------------------------------------------------------------- general questions
Q = []  # dicts: category, key, prompt, alts


def add(cat, key, q, *alts):
    Q.append(dict(category=cat, key=key, prompt=q, alts=list(alts)))


def ck(c):
    return "country:" + re.sub(r"^the ", "", c.lower()).replace("korea", "south korea").replace("south south", "south")


CAP1 = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Egypt", "Cairo"),
    ("Greece", "Athens"),
    ("England", "London"),
    ("the United Kingdom", "London"),
    ("Canada", "Ottawa"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Ireland", "Dublin"),
    ("Poland", "Warsaw"),
    ("Kenya", "Nairobi"),
    ("Thailand", "Bangkok"),
    ("Peru", "Lima"),
    ("Cuba", "Havana"),
    ("Denmark", "Copenhagen"),
    ("Finland", "Helsinki"),
    ("Hungary", "Budapest"),
    ("Belgium", "Brussels"),
    ("Chile", "Santiago"),
    ("Australia", "Canberra"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("South Korea", "Seoul"),
    ("Netherlands", "Amsterdam"),
    ("the Czech Republic", "Prague"),
    ("Romania", "Bucharest"),
    ("Ukraine", "Kyiv", "Kiev"),
    ("Iceland", "Reykjavik"),
    ("Nepal", "Kathmandu"),
    ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"),
    ("Syria", "Damascus"),
    ("Lebanon", "Beirut"),
    ("Saudi Arabia", "Riyadh"),
    ("Afghanistan", "Kabul"),
    ("Colombia", "Bogota", "Bogotá"),
    ("Venezuela", "Caracas"),
    ("Morocco", "Rabat"),
    ("Ghana", "Accra"),
    ("Scotland", "Edinburgh"),
    ("Wales", "Cardiff"),
    ("Switzerland", "Bern"),
    ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"),
    ("Argentina", "Buenos Aires"),
    ("Jamaica", "Kingston"),
    ("Qatar", "Doha"),
    ("Jordan", "Amman"),
    ("Libya", "Tripoli"),
    ("Tunisia", "Tunis"),
    ("Algeria", "Algiers"),
    ("Sudan", "Khartoum"),
    ("Uganda", "Kampala"),
    ("Tanzania", "Dodoma"),
    ("Zimbabwe", "Harare"),
    ("Senegal", "Dakar"),
    ("Mali", "Bamako"),
    ("Somalia", "Mogadishu"),
    ("Ecuador", "Quito"),
    ("Bolivia", "Sucre", "La Paz"),
    ("Uruguay", "Montevideo"),
    ("Paraguay", "Asuncion", "Asunción"),
    ("Nicaragua", "Managua"),
    ("Honduras", "Tegucigalpa"),
    ("Haiti", "Port-au-Prince"),
    ("Slovakia", "Bratislava"),
    ("Slovenia", "Ljubljana"),
    ("Estonia", "Tallinn"),
    ("Latvia", "Riga"),
    ("Lithuania", "Vilnius"),
    ("Belarus", "Minsk"),
    ("Albania", "Tirana"),
    ("Armenia", "Yerevan"),
    ("Georgia", "Tbilisi"),
    ("Azerbaijan", "Baku"),
    ("Kazakhstan", "Astana"),
    ("Uzbekistan", "Tashkent"),
    ("Mongolia", "Ulaanbaatar"),
    ("Bangladesh", "Dhaka"),
    ("Pakistan", "Islamabad"),
    ("Myanmar", "Naypyidaw"),
    ("Cambodia", "Phnom Penh"),
    ("Laos", "Vientiane"),
    ("Taiwan", "Taipei"),
    ("Malaysia", "Kuala Lumpur"),
    ("New Zealand", "Wellington"),
    ("Fiji", "Suva"),
    ("Cyprus", "Nicosia"),
    ("Malta", "Valletta"),
    ("Nigeria", "Abuja"),
    ("Ethiopia", "Addis Ababa"),
    ("Brazil", "Brasilia", "Brasília"),
    ("India", "New Delhi"),
    ("Mexico", "Mexico City"),
    ("Israel", "Jerusalem"),
]
for c, *k in CAP1:
    add("capital", ck(c), f"What is the capital of {c}?", *k)
for c, k in [
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Germany", "Berlin"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
]:
    add("capital", ck(c), f"What is the capital city of {c}?", k)

LANG = [
    ("France", "French"),
    ("Germany", "German"),
    ("Italy", "Italian"),
    ("Spain", "Spanish"),
    ("Japan", "Japanese"),
    ("China", "Chinese", "Mandarin"),
    ("Russia", "Russian"),
    ("Portugal", "Portuguese"),
    ("Brazil", "Portuguese"),
    ("Mexico", "Spanish"),
    ("Greece", "Greek"),
    ("Turkey", "Turkish"),
    ("Poland", "Polish"),
    ("Sweden", "Swedish"),
    ("the Netherlands", "Dutch"),
    ("Egypt", "Arabic"),
    ("South Korea", "Korean"),
    ("Israel", "Hebrew"),
    ("Finland", "Finnish"),
    ("Norway", "Norwegian"),
    ("England", "English"),
    ("Australia", "English"),
    ("Argentina", "Spanish"),
    ("Iran", "Persian", "Farsi"),
    ("Thailand", "Thai"),
    ("Vietnam", "Vietnamese"),
    ("Denmark", "Danish"),
    ("Hungary", "Hungarian"),
    ("Peru", "Spanish"),
    ("Chile", "Spanish"),
    ("Colombia", "Spanish"),
    ("Cuba", "Spanish"),
    ("Austria", "German"),
    ("Ukraine", "Ukrainian"),
    ("Romania", "Romanian"),
    ("Czech Republic", "Czech"),
    ("Indonesia", "Indonesian"),
    ("Saudi Arabia", "Arabic"),
    ("Pakistan", "Urdu"),
    ("Bangladesh", "Bengali", "Bangla"),
    ("Iceland", "Icelandic"),
    ("Canada", "English", "French"),
    ("the United States", "English"),
    ("New Zealand", "English"),
    ("Croatia", "Croatian"),
    ("Serbia", "Serbian"),
    ("Bulgaria", "Bulgarian"),
]
for c, *langs in LANG:
    add("language", ck(c), f"What language is mainly spoken in {c}?", *langs)
    add("language", ck(c), f"What is the official language of {c}?", *langs)
add("language", ck("the United States"), "What is the primary language of the United States?", "English")
for c, cur in [
    ("Japan", ["yen"]),
    ("the United Kingdom", ["pound"]),
    ("the United States", ["dollar"]),
    ("Germany", ["euro"]),
    ("India", ["rupee"]),
    ("France", ["euro"]),
    ("China", ["yuan", "renminbi"]),
    ("Russia", ["ruble", "rouble"]),
    ("Mexico", ["peso"]),
    ("Italy", ["euro"]),
    ("Spain", ["euro"]),
    ("Switzerland", ["franc"]),
    ("Canada", ["dollar"]),
    ("Australia", ["dollar"]),
    ("Brazil", ["real"]),
    ("South Korea", ["won"]),
    ("Turkey", ["lira"]),
    ("Sweden", ["krona"]),
]:
    add("fact", ck(c), f"What is the currency of {c}?", *cur)

COL = [
    ("sky", "the sky", ["blue"]),
    ("grass", "grass", ["green"]),
    ("snow", "snow", ["white"]),
    ("coal", "coal", ["black"]),
    ("banana", "a banana", ["yellow"]),
    ("tomato", "a ripe tomato", ["red"]),
    ("milk", "milk", ["white"]),
    ("lemon", "a lemon", ["yellow"]),
    ("blood", "blood", ["red"]),
    ("strawberry", "a strawberry", ["red"]),
    ("crow", "a crow", ["black"]),
    ("chocolate", "chocolate", ["brown"]),
    ("emerald", "an emerald", ["green"]),
    ("ruby", "a ruby", ["red"]),
    ("sapphire", "a sapphire", ["blue"]),
    ("carrot", "a carrot", ["orange"]),
    ("pumpkin", "a pumpkin", ["orange"]),
    ("polar bear", "a polar bear", ["white"]),
    ("eggplant", "an eggplant", ["purple"]),
    ("sun", "the sun", ["yellow"]),
    ("fire truck", "a fire truck", ["red"]),
    ("ocean", "the ocean", ["blue"]),
    ("cherry", "a cherry", ["red"]),
    ("lime", "a lime", ["green"]),
    ("cloud", "a cloud", ["white"]),
    ("ink", "ink", ["black", "blue"]),
    ("orange", "an orange", ["orange"]),
    ("frog", "a frog", ["green"]),
    ("flamingo", "a flamingo", ["pink"]),
    ("leaf", "a leaf", ["green"]),
    ("salt", "salt", ["white"]),
    ("tire", "a car tire", ["black"]),
    ("cucumber", "a cucumber", ["green"]),
    ("plum", "a plum", ["purple"]),
    ("corn", "corn", ["yellow"]),
    ("broccoli", "broccoli", ["green"]),
    ("night sky", "the night sky", ["black", "dark"]),
    ("gold", "gold", ["gold", "yellow"]),
    ("coffee", "coffee", ["brown", "black"]),
]
for key, obj, a in COL:
    add("color", "color:" + key, f"What color is {obj}?", *a)
    add("color", "color:" + key, f"What is the color of {obj}?", *a)
for q, *a in [
    ("blue and yellow", "green"),
    ("red and white", "pink"),
    ("red and blue", "purple"),
    ("red and yellow", "orange"),
    ("black and white", "gray", "grey"),
]:
    add("color", "mix:" + q, f"What color do you get by mixing {q}?", *a)

OPP = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("light", "dark"),
    ("good", "bad"),
    ("rich", "poor"),
    ("full", "empty"),
    ("hard", "soft"),
    ("high", "low"),
    ("strong", "weak"),
    ("wet", "dry"),
    ("long", "short"),
    ("loud", "quiet"),
    ("clean", "dirty"),
    ("day", "night"),
    ("yes", "no"),
    ("black", "white"),
    ("left", "right"),
    ("push", "pull"),
    ("love", "hate"),
    ("true", "false"),
    ("alive", "dead"),
    ("open", "closed"),
    ("win", "lose"),
    ("early", "late"),
    ("old", "young"),
    ("in", "out"),
    ("north", "south"),
    ("east", "west"),
    ("thick", "thin"),
    ("heavy", "light"),
    ("above", "below"),
    ("inside", "outside"),
    ("before", "after"),
    ("first", "last"),
    ("begin", "end"),
    ("start", "finish"),
    ("buy", "sell"),
    ("give", "take"),
    ("come", "go"),
    ("laugh", "cry"),
    ("question", "answer"),
    ("friend", "enemy"),
    ("war", "peace"),
    ("top", "bottom"),
    ("front", "back"),
    ("near", "far"),
    ("narrow", "wide"),
    ("sweet", "sour"),
    ("cheap", "expensive"),
    ("safe", "dangerous"),
    ("asleep", "awake"),
    ("always", "never"),
    ("everything", "nothing"),
    ("entrance", "exit"),
    ("input", "output"),
    ("maximum", "minimum"),
    ("positive", "negative"),
    ("male", "female"),
    ("king", "queen"),
    ("boy", "girl"),
    ("man", "woman"),
    ("brother", "sister"),
    ("father", "mother"),
    ("husband", "wife"),
    ("uncle", "aunt"),
    ("summer", "winter"),
    ("sunrise", "sunset"),
    ("success", "failure"),
    ("arrive", "leave"),
    ("remember", "forget"),
    ("accept", "reject"),
    ("increase", "decrease"),
    ("ancient", "modern"),
    ("smooth", "rough"),
    ("deep", "shallow"),
    ("brave", "cowardly"),
    ("tall", "short"),
    ("healthy", "sick"),
    ("polite", "rude"),
    ("sharp", "dull"),
    ("major", "minor"),
    ("private", "public"),
    ("visible", "invisible"),
    ("possible", "impossible"),
]
for a, b in OPP:
    key = "opp:" + "/".join(sorted([a, b]))
    add("opposite", key, f"What is the opposite of {a}?", b)
    if (b, a) not in OPP and b not in ("short", "light"):  # reverse direction; 'short'/'light' have two opposites
        add("opposite", key, f"What is the opposite of {b}?", a)
add("opposite", "opp:down/up", "What is the opposite of the word up?", "down")

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
for i, d in enumerate(DAYS):
    add("calendar", "day:" + d, f"What day comes after {d}?", DAYS[(i + 1) % 7])
    add("calendar", "day:" + d, f"What is the day after {d}?", DAYS[(i + 1) % 7])
    add("calendar", "day:" + d, f"What day comes before {DAYS[(i + 1) % 7]}?", d)
MON = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
for i in range(11):
    add("calendar", "month:" + MON[i], f"What month comes after {MON[i]}?", MON[i + 1])
    add("calendar", "month:" + MON[i], f"What is the month after {MON[i]}?", MON[i + 1])
add("calendar", "month:first", "What is the first month of the year?", "January")
add("calendar", "month:last", "What is the last month of the year?", "December")
for s, n in [("winter", "spring"), ("spring", "summer"), ("summer", "autumn"), ("autumn", "winter")]:
    add("calendar", "season:" + s, f"What season comes after {s}?", *([n, "fall"] if n == "autumn" else [n]))
add("calendar", "season:coldest", "What is the coldest season?", "winter")
add("calendar", "season:hottest", "What is the hottest season?", "summer")

NUMW = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]


def num(n):
    return [str(n)] + ([NUMW[n]] if 0 <= n <= 20 else [])


for a, b in [
    (1, 1),
    (2, 2),
    (2, 3),
    (3, 3),
    (4, 4),
    (5, 5),
    (1, 2),
    (3, 4),
    (6, 2),
    (5, 4),
    (7, 1),
    (8, 2),
    (10, 10),
    (4, 3),
    (6, 3),
    (9, 1),
    (3, 5),
    (2, 5),
    (7, 3),
    (10, 5),
    (6, 6),
    (8, 8),
    (9, 9),
    (7, 7),
    (4, 6),
]:
    add("arithmetic", f"plus:{a}+{b}", f"What is {a} plus {b}?", *num(a + b))
    add("arithmetic", f"plus:{a}+{b}", f"What is the sum of {a} and {b}?", *num(a + b))
for a, b in [(2, 2), (3, 3), (2, 3), (5, 2), (4, 2), (10, 2), (3, 4), (5, 5), (6, 2), (10, 10), (4, 4), (3, 5)]:
    add("arithmetic", f"times:{a}x{b}", f"What is {a} times {b}?", *num(a * b))
for a, b in [(5, 2), (10, 5), (9, 3), (8, 4), (7, 2), (6, 1), (10, 1), (4, 2), (9, 4), (8, 3)]:
    add("arithmetic", f"minus:{a}-{b}", f"What is {a} minus {b}?", *num(a - b))
for q, a in [
    ("What is the square root of 9?", num(3)),
    ("What is the square root of 16?", num(4)),
    ("What is half of 10?", num(5)),
    ("What is half of 100?", ["50"]),
    ("What is 10 divided by 2?", num(5)),
    ("What is 100 divided by 10?", num(10)),
]:
    add("arithmetic", "q:" + q, q, *a)
for q, n in [
    ("a triangle", 3),
    ("a square", 4),
    ("a pentagon", 5),
    ("a hexagon", 6),
    ("an octagon", 8),
    ("a rectangle", 4),
]:
    add("count", "sides:" + q, f"How many sides does {q} have?", *num(n))
for q, n in [
    ("legs does a spider have", 8),
    ("legs does a dog have", 4),
    ("legs does a bird have", 2),
    ("days are in a week", 7),
    ("months are in a year", 12),
    ("hours are in a day", 24),
    ("minutes are in an hour", 60),
    ("seconds are in a minute", 60),
    ("wheels does a bicycle have", 2),
    ("wheels does a tricycle have", 3),
    ("legs does an insect have", 6),
    ("continents are there", 7),
    ("planets are in the solar system", 8),
    ("eyes does a human have", 2),
    ("fingers are on one hand", 5),
    ("days are in a year", 365),
    ("wheels does a car have", 4),
    ("legs does a cow have", 4),
    ("days are in a leap year", 366),
    ("years are in a century", 100),
]:
    add("count", "count:" + q, f"How many {q}?", *num(n))
for q, a in [
    ("moo", "cow"),
    ("woof", "dog"),
    ("meow", "cat"),
    ("oink", "pig"),
    ("quack", "duck"),
    ("baa", "sheep"),
    ("neigh", "horse"),
    ("hoot", "owl"),
    ("roar", "lion"),
    ("ribbit", "frog"),
]:
    add("animal", "says:" + q, f"Which animal says {q}?", a)

FACT_MERGE = {
    "What is the largest planet?": "largest planet",
    "What is the largest planet in the solar system?": "largest planet",
    "What is the largest animal on Earth?": "largest animal",
    "What is the largest mammal?": "largest animal",
    "What is the closest star to Earth?": "sun",
    "What is the name of the star at the center of our solar system?": "sun",
    "What natural satellite orbits the Earth?": "moon",
    "What is the name of Earth's natural satellite?": "moon",
    "What is the tallest animal?": "giraffe",
    "Which animal is known for its long neck?": "giraffe",
    "What do bees make?": "honey",
    "What insect makes honey?": "honey",
    "In which country is the Eiffel Tower?": "eiffel",
    "In which city is the Eiffel Tower?": "eiffel",
    "What planet do we live on?": "earth",
    "What is the third planet from the sun?": "earth",
    "Which planet is known as the Red Planet?": "mars",
    "What is the fourth planet from the sun?": "mars",
    "What is the chemical symbol for oxygen?": "oxygen",
    "What gas do humans need to breathe?": "oxygen",
    "What is the boiling point of water in Celsius?": "boil",
    "What is the boiling point of water in Fahrenheit?": "boil",
    "What is the national animal of Australia?": "kangaroo",
    "Which animal hops and has a pouch?": "kangaroo",
}
FACTS = [
    ("What planet do we live on?", "Earth"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("What is the closest star to Earth?", "Sun"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is frozen water called?", "ice"),
    ("What do bees make?", "honey"),
    ("What gas do humans need to breathe?", "oxygen"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the chemical symbol for oxygen?", "O"),
    ("What is the hardest natural substance?", "diamond"),
    ("What organ pumps blood through the body?", "heart"),
    ("What organ do we use to think?", "brain"),
    ("What organ do we use to breathe?", "lungs"),
    ("What do plants need from the sun to grow?", "light", "sunlight"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the largest animal on Earth?", "whale", "blue whale"),
    ("What is the tallest animal?", "giraffe"),
    ("What is the fastest land animal?", "cheetah"),
    ("What animal is known as the king of the jungle?", "lion"),
    ("What is the largest continent?", "Asia"),
    ("What is the longest river in the world?", "Nile", "Amazon"),
    ("What is the largest desert in the world?", "Sahara", "Antarctica"),
    ("What natural satellite orbits the Earth?", "Moon"),
    ("What is the boiling point of water in Celsius?", "100"),
    ("What is the freezing point of water in Celsius?", "0", "zero"),
    ("What do caterpillars turn into?", "butterflies", "butterfly"),
    ("What do cows drink?", "water"),
    ("What do cows produce that people drink?", "milk"),
    ("What do hens lay?", "eggs"),
    ("What is the baby of a cat called?", "kitten"),
    ("What is the baby of a dog called?", "puppy"),
    ("What is the baby of a cow called?", "calf"),
    ("What is the baby of a sheep called?", "lamb"),
    ("What is the baby of a horse called?", "foal"),
    ("What is a baby frog called?", "tadpole"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo", "da Vinci"),
    ("Who was the first president of the United States?", "Washington"),
    ("Who discovered gravity?", "Newton"),
    ("Who developed the theory of relativity?", "Einstein"),
    ("What do you call a shape with three sides?", "triangle"),
    ("What shape is a ball?", "sphere", "round", "circle"),
    ("What shape has four equal sides?", "square"),
    ("What is the main ingredient in bread?", "flour"),
    ("What fruit is used to make wine?", "grapes", "grape"),
    ("What is the main ingredient in guacamole?", "avocado"),
    ("What do pandas eat?", "bamboo"),
    ("What do monkeys like to eat?", "bananas", "banana"),
    ("What instrument has 88 keys?", "piano"),
    ("What sport uses a bat and a ball and wickets?", "cricket"),
    ("What is the national sport of Japan?", "sumo"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("In which country is the Eiffel Tower?", "France"),
    ("In which city is the Eiffel Tower?", "Paris"),
    ("In which city is the Colosseum?", "Rome"),
    ("In which country is the Great Wall?", "China"),
    ("In which country is the Taj Mahal?", "India"),
    ("What do we call a person who teaches?", "teacher"),
    ("What do we call a person who flies a plane?", "pilot"),
    ("What do we call a doctor for animals?", "vet", "veterinarian"),
    ("What do we call a person who fixes teeth?", "dentist"),
    ("What do we call a person who cooks in a restaurant?", "chef", "cook"),
    ("What do we call a person who writes books?", "author", "writer"),
    ("What metal is attracted to magnets?", "iron"),
    ("What is the largest mammal?", "whale", "blue whale"),
    ("What bird is a symbol of peace?", "dove"),
    ("What insect makes honey?", "bee", "bees"),
    ("What is the biggest bird?", "ostrich"),
    ("Which animal has a trunk?", "elephant"),
    ("Which animal has black and white stripes?", "zebra"),
    ("Which animal carries its house on its back?", "snail", "turtle"),
    ("Which animal is known for its long neck?", "giraffe"),
    ("Which animal hops and has a pouch?", "kangaroo"),
    ("What do you use to write on a blackboard?", "chalk"),
    ("What do you use to cut paper?", "scissors"),
    ("What do you wear on your feet?", "shoes", "socks"),
    ("What do you wear on your head?", "hat"),
    ("What falls from clouds when it rains?", "water", "rain"),
    ("What is the center of an atom called?", "nucleus"),
    ("What force keeps us on the ground?", "gravity"),
    ("What is the study of living things called?", "biology"),
    ("What is the study of the stars called?", "astronomy"),
    ("What is the largest planet?", "Jupiter"),
    ("What is the smallest planet?", "Mercury"),
    ("What is the hottest planet?", "Venus"),
    ("What is the third planet from the sun?", "Earth"),
    ("What is the fourth planet from the sun?", "Mars"),
    ("What is the largest country by area?", "Russia"),
    ("What is the most populous country?", "China", "India"),
    ("What is the largest city in the United States?", "New York"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What is the main gas in the air we breathe?", "nitrogen"),
    ("What is the symbol for sodium?", "Na"),
    ("What is the symbol for iron?", "Fe"),
    ("What is the boiling point of water in Fahrenheit?", "212"),
    ("What is the name of our galaxy?", "Milky Way"),
    ("What is the name of the star at the center of our solar system?", "Sun"),
    ("What is the name of Earth's natural satellite?", "Moon"),
    ("What is the national animal of Australia?", "kangaroo"),
    ("What is the national bird of the United States?", "eagle"),
    ("What do bees live in?", "hive", "beehive"),
    ("What do spiders spin?", "web", "webs"),
    ("What do we breathe out?", "carbon dioxide"),
    ("What is the largest organ of the human body?", "skin"),
    ("What do you call a baby kangaroo?", "joey"),
    ("What is the opposite of north on a compass?", "south"),
    ("Which planet has rings?", "Saturn"),
    ("What is the hottest star in the night sky?", "Sirius"),
    ("Who invented the telephone?", "Bell"),
    ("Who invented the light bulb?", "Edison"),
    ("What is the smallest prime number?", "2", "two"),
    ("What do you call frozen rain?", "hail", "sleet"),
    ("What do birds use to fly?", "wings"),
    ("What do fish use to breathe?", "gills"),
    ("What is the capital letter of the alphabet's first letter?", "A"),
]
for q, *a in FACTS:
    add("fact", "fact:" + FACT_MERGE.get(q, q), q, *a)

# ---------------------------------------------------------------- teacher context
SYSTEM = (
    "If the user asks for the plural of a noun, reply with only the plural word in lowercase. "
    "For any other question, answer normally in one full sentence."
)
# general demo turns: the base model's own style; their keys are reserved (never in suite/replay)
GEN_DEMO = [
    ("What is the capital of France?", "The capital of France is Paris.", ck("France")),
    ("What is the opposite of happy?", "The opposite of happy is sad.", "opp:happy/sad"),
    ("What color is grass?", "The color of grass is green.", "color:grass"),
    ("What is 2 plus 2?", "The sum of 2 and 2 is 4.", "plus:2+2"),
]


def teacher_context(order="interleave"):
    msgs = [{"role": "system", "content": SYSTEM}]
    P = [(plural_prompt(w), plural_answer(w)) for w in PLURAL_DEMO]
    G = [(q, a) for q, a, _ in GEN_DEMO]
    turns = []
    if order == "interleave":
        for i in range(max(len(P), len(G))):
            if i < len(P):
                turns.append(P[i])
            if i < len(G):
                turns.append(G[i])
    else:
        turns = P + G
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs


def dedup(qs):
    seen = set()
    out = []
    for x in qs:
        if x["prompt"] in seen:
            continue
        seen.add(x["prompt"])
        out.append(x)
    return out


def candidates():
    reserved = {k for _, _, k in GEN_DEMO}
    qs = [x for x in dedup(Q) if x["key"] not in reserved]
    # drop items whose reference appears in the question itself (lucky echo hits)
    qs = [x for x in qs if not any(contains_answer(x["prompt"], a) for a in x["alts"])]
    return qs


def key_side(key, replay_frac=0.45):
    h = int(hashlib.sha256(("smol_v2:" + key).encode()).hexdigest(), 16)
    return "replay" if (h % 1000) < replay_frac * 1000 else "suite"


VARIANTS = [
    ("bare", "{q}"),
    ("question", "Question: {q}"),
    ("brief", "{q} Answer briefly."),
    ("please", "Please tell me: {q}"),
]
MAX_NEW = 32
N_SUITE, N_REPLAY = 150, 200
# a script of the repository, not of an installed package: it writes the shipped data of campaigns/smollm2.yaml
HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "campaigns", "data", "smollm2")


def base_generate(threads):
    """The base model's greedy answers (default system prompt, as the campaign asks it bare)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from campaign_orchestrator import models
    from campaigns import paths

    path = str(models.resolve("@packaged/smollm2-135m-instruct", paths.artifact_root()))
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}

    @torch.no_grad()
    def gen(prompts, bs=32):
        out, t0 = {}, time.time()
        order = sorted(prompts, key=lambda p: (len(p), p))
        for s in range(0, len(order), bs):
            chunk = order[s : s + bs]
            texts = [
                tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in chunk
            ]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            g = m.generate(
                **enc, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=sorted(stop)
            )
            for p, row in zip(chunk, g[:, enc.input_ids.shape[1] :].tolist(), strict=False):
                cut = next((k for k, t in enumerate(row) if t in stop), None)
                out[p] = tok.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
        print(f"  base: {len(prompts)} prompts in {time.time() - t0:.0f} s", flush=True)
        return out

    return gen


# ---------------------------------------------------------------- facts: the country a city is in
# Non-capital cities of countries with one-word English names (capitals are the general suite's and a hidden task's;
# "the United States" or "South Africa" would not be one word; "the Philippines" would carry an article). Left out:
# names shared by two well-known places (Valencia, Cordoba, Perth, Victoria, Halifax, Alexandria, Salvador, Natal,
# Newcastle, Kingston, Hamilton, Tripoli, Leon, Cuenca, Lagos in Portugal) and islands.
CITIES = {
    "france": "Lyon Nice Bordeaux Toulouse Lille Strasbourg Nantes Cannes Montpellier Rennes Reims Grenoble "
    "Dijon Avignon Le_Havre Toulon Versailles Calais Biarritz Lourdes Chamonix Orleans Limoges Rouen "
    "Amiens Metz Perpignan Ajaccio Saint_Tropez",
    "germany": "Hamburg Frankfurt Cologne Stuttgart Dresden Leipzig Dusseldorf Bremen Nuremberg Hanover "
    "Dortmund Essen Heidelberg Bonn Mainz Freiburg Augsburg Potsdam Kiel Rostock Wiesbaden Karlsruhe "
    "Mannheim Regensburg Wurzburg Aachen Munster Bielefeld Duisburg Bochum Wuppertal Lubeck Weimar",
    "italy": "Venice Florence Naples Turin Bologna Genoa Palermo Verona Pisa Bari Catania Siena Padua Trieste "
    "Parma Modena Messina Rimini Ravenna Lucca Bergamo Brescia Perugia Cagliari Sorrento Amalfi "
    "Assisi Como",
    "spain": "Seville Bilbao Malaga Granada Zaragoza Toledo Salamanca Alicante Pamplona Cadiz Murcia Marbella "
    "Benidorm Santander Valladolid Gijon Oviedo Almeria Tarragona Girona Segovia Burgos",
    "portugal": "Porto Faro Coimbra Braga Funchal Sintra Evora Aveiro Cascais",
    "japan": "Kyoto Hiroshima Nagasaki Yokohama Sapporo Kobe Nagoya Fukuoka Nara Sendai Okinawa Kawasaki "
    "Kagoshima Kanazawa Nikko Hakodate Matsuyama Okayama Kumamoto Niigata Shizuoka Chiba",
    "china": "Shanghai Guangzhou Shenzhen Chengdu Wuhan Nanjing Hangzhou Tianjin Harbin Chongqing Xian "
    "Qingdao Suzhou Dalian Kunming Guilin Lhasa Xiamen Ningbo Shenyang Changsha Zhengzhou Jinan "
    "Urumqi",
    "india": "Bangalore Kolkata Chennai Hyderabad Jaipur Agra Pune Ahmedabad Varanasi Lucknow Kanpur Surat "
    "Amritsar Mysore Bhopal Indore Nagpur Patna Kochi Madurai Udaipur Jodhpur Shimla Darjeeling "
    "Rishikesh Visakhapatnam Chandigarh Coimbatore",
    "australia": "Melbourne Brisbane Adelaide Darwin Hobart Cairns Geelong Wollongong Townsville Launceston "
    "Ballarat Bendigo Toowoomba Fremantle",
    "canada": "Vancouver Montreal Calgary Edmonton Winnipeg Saskatoon Regina Mississauga Kelowna Whistler "
    "Banff Moncton Kamloops Nanaimo Thunder_Bay",
    "brazil": "Recife Manaus Fortaleza Curitiba Belem Sao_Paulo Rio_de_Janeiro Porto_Alegre Florianopolis "
    "Goiania Campinas",
    "russia": "Novosibirsk Vladivostok Kazan Sochi Yekaterinburg Murmansk Omsk Samara Volgograd Irkutsk "
    "Saint_Petersburg Krasnoyarsk Chelyabinsk Kaliningrad Rostov Ufa Perm Tomsk Khabarovsk Yakutsk "
    "Arkhangelsk",
    "mexico": "Cancun Guadalajara Monterrey Tijuana Acapulco Puebla Oaxaca Merida Veracruz Mazatlan Ensenada "
    "Queretaro Cuernavaca Tulum Playa_del_Carmen",
    "turkey": "Istanbul Izmir Antalya Bursa Konya Adana Trabzon Bodrum Gaziantep Diyarbakir Kayseri Eskisehir Samsun",
    "egypt": "Luxor Aswan Giza Sharm_el_Sheikh Hurghada Port_Said Suez",
    "switzerland": "Zurich Geneva Basel Lucerne Lausanne Lugano Zermatt Interlaken Davos Montreux",
    "austria": "Salzburg Innsbruck Graz Linz Hallstatt Klagenfurt Bregenz Villach",
    "poland": "Krakow Gdansk Wroclaw Poznan Lodz Katowice Lublin Szczecin Bydgoszcz Torun Zakopane",
    "greece": "Thessaloniki Patras Heraklion Larissa Volos Kalamata Chania Ioannina",
    "argentina": "Mendoza Rosario Ushuaia Bariloche Salta Tucuman La_Plata Mar_del_Plata",
    "pakistan": "Karachi Lahore Peshawar Quetta Faisalabad Rawalpindi Multan Sialkot",
    "morocco": "Casablanca Marrakech Fez Tangier Agadir Meknes Essaouira Chefchaouen Ouarzazate",
    "nigeria": "Lagos Kano Ibadan Kaduna Enugu Port_Harcourt",
    "kenya": "Mombasa Kisumu Nakuru Eldoret",
    "thailand": "Phuket Pattaya Chiang_Mai Krabi Ayutthaya Hua_Hin Chiang_Rai",
    "israel": "Haifa Eilat Nazareth Tel_Aviv",
    "ireland": "Cork Galway Limerick Kilkenny Waterford Sligo",
    "belgium": "Antwerp Bruges Ghent Liege Leuven Namur Mons Ostend",
    "sweden": "Gothenburg Malmo Uppsala Kiruna Lund Linkoping Orebro",
    "norway": "Bergen Trondheim Stavanger Tromso Alesund Bodo",
    "denmark": "Aarhus Odense Aalborg Esbjerg",
    "finland": "Tampere Turku Oulu Rovaniemi Espoo Lahti",
    "colombia": "Medellin Cartagena Cali Barranquilla Santa_Marta Bucaramanga",
    "peru": "Cusco Arequipa Trujillo Iquitos Chiclayo Piura Puno",
    "chile": "Valparaiso Antofagasta Valdivia Iquique Punta_Arenas Concepcion",
    "netherlands": "Rotterdam Utrecht Eindhoven Haarlem Leiden Delft Groningen Maastricht",
    "scotland": "Glasgow Aberdeen Dundee Inverness Stirling",
    "vietnam": "Saigon Haiphong Hue Da_Nang Nha_Trang Hoi_An Can_Tho",
    "indonesia": "Surabaya Bandung Medan Yogyakarta Denpasar Makassar Semarang Palembang",
    "iran": "Isfahan Shiraz Tabriz Mashhad Qom Yazd Kerman Ahvaz",
    "iraq": "Basra Mosul Kirkuk Erbil Najaf Karbala",
    "ukraine": "Odessa Kharkiv Lviv Dnipro Zaporizhzhia Donetsk Mariupol Chernobyl",
    "venezuela": "Maracaibo Barquisimeto Ciudad_Bolivar",
    "ecuador": "Guayaquil Manta",
    "bangladesh": "Chittagong Khulna Sylhet",
    "syria": "Aleppo Homs Latakia Palmyra",
    "croatia": "Split Dubrovnik Zadar Rijeka Pula",
    "romania": "Cluj Timisoara Brasov Constanta Iasi Sibiu",
    "malaysia": "Penang Ipoh Malacca Kuching",
    "hungary": "Debrecen Szeged Pecs",
    "bulgaria": "Plovdiv Varna Burgas",
    "serbia": "Novi_Sad Nis",
    "slovakia": "Kosice",
    "cuba": "Santiago_de_Cuba Varadero",
    "jamaica": "Montego_Bay",
    "nepal": "Pokhara",
    "jordan": "Petra Aqaba",
    "lebanon": "Byblos",
    "tunisia": "Sousse Sfax",
    "algeria": "Oran",
    "ethiopia": "Gondar Lalibela",
    "tanzania": "Arusha",
    "ghana": "Kumasi",
    "cameroon": "Douala",
    "uganda": "Entebbe",
    "wales": "Swansea",
}
CITY_DEMO = [  # the teacher's few-shot turns (campaigns/smollm2_facts*.yaml); never in the train or suite files
    ("Marseille", "France"),
    ("Munich", "Germany"),
    ("Osaka", "Japan"),
    ("Barcelona", "Spain"),
    ("Toronto", "Canada"),
    ("Mumbai", "India"),
    ("Sydney", "Australia"),
    ("Milan", "Italy"),
]
# The task's prompt, and the only phrasing a city is selected under: "the base knows it" means it names the country
# when asked the task's own question (a city it names only under another phrasing is a fact the task's prompt does
# not reach, and the diagnosis scores the base on the task's prompt).
CITY_PHRASINGS = [("bare", "In which country is the city of {c}?")]
FACTS_SUITE_SHARE = 0.35


def cities():
    out = [(c.replace("_", " "), k) for k, v in CITIES.items() for c in v.split()]
    demo = {c for c, _ in CITY_DEMO}
    assert not demo & {c for c, _ in out} and len({c for c, _ in out}) == len(out)
    return out


def fact_prompt(city):
    return CITY_PHRASINGS[0][1].format(c=city)


def fact_side(city):
    h = int(hashlib.sha256(("facts:" + city).encode()).hexdigest(), 16)
    return "suite" if (h % 1000) < FACTS_SUITE_SHARE * 1000 else "train"


def facts_files(cache_dir, threads, gen=None):
    """facts-train.jsonl and facts-suite.jsonl: the cities whose country the base names in a sentence to the task's
    prompt (its answers cached in ``cache_dir``), split by city hash, the country capitalized as text writes it (the
    tokenizer's whole-word pieces: "Argentina" is ``Ar gent ina``, "argentina" ``arg ent ina``;
    benchmarks/facts_format_probe.py measured the difference); returns the generator (to share the loaded model)
    and the counts."""
    pool = cities()
    known = set()
    for name, tpl in CITY_PHRASINGS:
        path = os.path.join(cache_dir, f"facts_{name}.json")
        cache = json.load(open(path)) if os.path.exists(path) else {}
        todo = [tpl.format(c=c) for c, _ in pool if tpl.format(c=c) not in cache]
        if todo:
            gen = gen or base_generate(threads)
            cache.update(gen(todo))
            json.dump(cache, open(path, "w"), indent=0, sort_keys=True)
        right = {c for c, k in pool if contains_answer(cache[tpl.format(c=c)], k)}
        print(f"facts, {name}: the base names the country of {len(right)} of {len(pool)} cities", flush=True)
        known |= right
    rows = {"train": [], "suite": []}
    for c, k in pool:
        if c in known:
            rows[fact_side(c)].append((c, k))
    out = {}
    for side, tag in (("train", "tr"), ("suite", "te")):
        out[side] = [
            dict(id=f"fa-{tag}-{i:03d}", prompt=fact_prompt(c), reference=k.title(), category="country")
            for i, (c, k) in enumerate(sorted(rows[side], key=lambda x: (x[1], x[0])))
        ]
    return gen, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.path.join(HERE, ".cache"), help="the base model's outputs (JSON per variant)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["facts"], help="write only these files (the others need their own cache)")
    a = ap.parse_args()

    def dump(name, rows):
        with open(os.path.join(HERE, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    os.makedirs(a.cache, exist_ok=True)
    gen, facts = facts_files(a.cache, a.threads)
    dump("facts-train.jsonl", facts["train"])
    dump("facts-suite.jsonl", facts["suite"])
    print(f"facts: {len(facts['train'])} train, {len(facts['suite'])} suite cities")
    if a.only == "facts":
        return

    tr, te = plural_split()
    dump(
        "train-plural.jsonl",
        [
            dict(id=f"pl-tr-{i:03d}", prompt=plural_prompt(w), reference=plural_answer(w), category="plural")
            for i, w in enumerate(tr)
        ],
    )
    dump(
        "suite-plural.jsonl",
        [
            dict(id=f"pl-te-{i:03d}", prompt=plural_prompt(w), reference=plural_answer(w), category="plural")
            for i, w in enumerate(te)
        ],
    )
    C = candidates()
    suite_c = [x for x in C if key_side(x["key"]) == "suite"]
    replay_c = [x for x in C if key_side(x["key"]) == "replay"]
    assert not ({x["key"] for x in suite_c} & {x["key"] for x in replay_c})
    rp = list(replay_c)
    random.Random(0).shuffle(rp)
    dump(
        "train-general.jsonl",
        [
            dict(id=f"rp-{i:03d}", prompt=x["prompt"], reference=x["alts"][0], category=x["category"])
            for i, x in enumerate(rp[:N_REPLAY])
        ],
    )

    alive = list(suite_c)
    ok_alts = {x["prompt"]: list(x["alts"]) for x in alive}
    for name, tpl in VARIANTS:  # sequential: each phrasing only on the survivors (same result as "all")
        path = os.path.join(a.cache, f"suite_{name}.json")
        cache = json.load(open(path)) if os.path.exists(path) else {}
        todo = [tpl.format(q=x["prompt"]) for x in alive if tpl.format(q=x["prompt"]) not in cache]
        if todo:
            gen = gen or base_generate(a.threads)
            cache.update(gen(todo))
            json.dump(cache, open(path, "w"), indent=0, sort_keys=True)
        nxt = []
        for x in alive:
            o = cache[tpl.format(q=x["prompt"])]
            ok_alts[x["prompt"]] = [al for al in ok_alts[x["prompt"]] if contains_answer(o, al)]
            if ok_alts[x["prompt"]]:
                nxt.append(x)
        alive = nxt
        print(f"{name}: {len(alive)} of {len(suite_c)} suite-side questions still answered correctly", flush=True)
    random.Random(0).shuffle(alive)
    alive = sorted(alive[:N_SUITE], key=lambda x: (x["category"], x["prompt"]))
    dump(
        "suite-general.jsonl",
        [
            dict(id=f"gen-{i:03d}", prompt=x["prompt"], reference=ok_alts[x["prompt"]][0], category=x["category"])
            for i, x in enumerate(alive)
        ],
    )
    from collections import Counter

    print(
        f"plural: {len(tr)} train, {len(te)} suite; general: {len(C)} candidates, replay {min(N_REPLAY, len(rp))}, "
        f"suite {len(alive)} {dict(Counter(x['category'] for x in alive))}"
    )


if __name__ == "__main__":
    main()
