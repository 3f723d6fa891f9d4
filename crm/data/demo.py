"""The embedded demo data: a synthetic world where the preferred response depends on the criteria.

Each response to a query has six style attributes, each with two poles (concise/detailed,
prose/bullets, formal/casual, no examples/examples, plain/vivid, confident/cautious). A pair is two
responses to one query that differ on k attributes (k = 1..5) and agree on the rest. The criteria
under which A wins name A's pole of every differing attribute; B's criteria name B's poles. Every
pole leaves visible marks in the tokens (sentence count, "- " bullets, the opener, "For example,",
"Picture ...", "Be careful: ..."), so a tiny model can learn to read them in minutes on CPU.

The human vote follows a "crowd taste" (detailed beats concise, examples beat none, ...) 75% of the
time, so a criteria-blind model can reach about 75% in distribution, and exactly 50% on the
contradictory test set, where every pair appears twice with opposite criteria and labels.

Every draw comes from `random.Random` streams derived from the seed by name, so the same seed gives
byte-identical files and each file is independent of the other files' sizes. `prepare_demo` is what
crm-train runs for data=demo: generate and shard once into the cache.
"""
from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from crm.core.files import write_json
from crm.data.shard import shard

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# style attributes: the id of an attribute is its `broad_criteria_topic`


@dataclass(frozen=True)
class Attribute:
    name: str
    poles: tuple[str, str]  # pole 0, pole 1; pole 1 is the "high" pole of a benchmark profile


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("length", ("concise", "detailed")),
    Attribute("structure", ("prose", "bullets")),
    Attribute("tone", ("formal", "casual")),
    Attribute("examples", ("no_examples", "examples")),
    Attribute("imagery", ("plain", "vivid")),
    Attribute("caution", ("confident", "cautious")),
)
LENGTH, STRUCTURE, TONE, EXAMPLES, IMAGERY, CAUTION = range(len(ATTRIBUTES))

# pole name -> (attribute id, pole index)
POLES: dict[str, tuple[int, int]] = {
    pole: (attr_id, side)
    for attr_id, attr in enumerate(ATTRIBUTES) for side, pole in enumerate(attr.poles)}

# Core sentences per response: the ranges do not touch, so length stays visible even when the
# concise side carries more of the one-sentence extras (example, image, caveat).
CORE_SENTENCES = {0: (1, 2), 1: (4, 6)}

# ---------------------------------------------------------------------------------------------
# criteria wordings, as users write them. TRAIN_WORDINGS appear in train.jsonl and every test file
# except heldout_wordings.jsonl, which uses HELDOUT_WORDINGS only.

TRAIN_WORDINGS: dict[str, tuple[str, ...]] = {
    "concise": (
        "I prefer short, to-the-point answers.",
        "Keep it brief, please.",
        "Just give me the gist in a sentence or two.",
        "I don't have much time, so be concise.",
        "Short answers only; skip the long explanations.",
        "Less is more: I want a quick answer.",
    ),
    "detailed": (
        "Give me the full picture, I like thorough explanations.",
        "I prefer detailed answers that cover everything.",
        "Please be thorough and explain each step.",
        "Longer, in-depth answers are better for me.",
        "Don't hold back on detail; I want to understand it fully.",
        "I like comprehensive responses with plenty of information.",
    ),
    "prose": (
        "Write in flowing paragraphs, not lists.",
        "Please avoid bullet points.",
        "I like answers written as normal prose.",
        "No lists, just talk me through it in sentences.",
        "Plain paragraphs read better to me than bullets.",
        "Keep it as running text without any list formatting.",
    ),
    "bullets": (
        "Please use bullet points.",
        "I like answers organized as a list.",
        "Break it down into bullet points I can skim.",
        "Format the answer as a list of points.",
        "Lists are easier for me to read than paragraphs.",
        "Give me a bulleted summary.",
    ),
    "formal": (
        "Keep the tone formal and professional.",
        "Please write in a professional manner.",
        "I prefer a serious, formal style.",
        "No slang; keep it polished and businesslike.",
        "Answer the way a professional consultant would.",
        "A respectful, formal tone is important to me.",
    ),
    "casual": (
        "Keep it casual and friendly.",
        "Talk to me like a friend would.",
        "I like a relaxed, conversational tone.",
        "Be informal and chatty, please.",
        "A warm, casual style works best for me.",
        "Don't be stiff; keep it light and friendly.",
    ),
    "no_examples": (
        "Skip the examples; just state the advice.",
        "I don't need examples, only the main points.",
        "No examples please, they slow me down.",
        "Stick to general advice without specific examples.",
        "Leave out illustrations and examples.",
        "Just the principles, no worked examples.",
    ),
    "examples": (
        "Please include a concrete example.",
        "I learn best from examples.",
        "Show me an example of what you mean.",
        "Give at least one specific example.",
        "Answers with real examples are more useful to me.",
        "Illustrate your advice with an example.",
    ),
    "plain": (
        "Use plain, literal language.",
        "No metaphors or flowery language, please.",
        "Keep the wording simple and direct.",
        "I prefer straightforward language without comparisons.",
        "Avoid figurative language; be literal.",
        "Skip the poetic imagery.",
    ),
    "vivid": (
        "I like vivid metaphors and imagery.",
        "Use colorful comparisons to make it memorable.",
        "Paint a picture for me with your words.",
        "Analogies help me understand, so use them.",
        "Make it vivid and imaginative.",
        "I enjoy descriptive, figurative language.",
    ),
    "confident": (
        "Be direct and confident; skip the disclaimers.",
        "I don't need warnings or caveats.",
        "Just tell me what to do without hedging.",
        "No safety notes, I know the risks.",
        "Give a confident answer without qualifications.",
        "Skip the caveats and the fine print.",
    ),
    "cautious": (
        "Please mention any risks or caveats.",
        "I want to know the safety considerations.",
        "Point out what could go wrong.",
        "Include warnings where they matter.",
        "Be careful and note any limitations.",
        "I appreciate answers that flag potential pitfalls.",
    ),
}

# One wording per pole shares words with the training wordings, the others are new phrasings:
# the held-out file measures how far the model generalizes beyond memorized strings.
HELDOUT_WORDINGS: dict[str, tuple[str, ...]] = {
    "concise": ("Answer briefly, I'm in a hurry.", "Please don't ramble.", "A one-liner is all I need."),
    "detailed": ("Walk me through it in depth.", "The more detail, the better.",
                 "I want an exhaustive, complete explanation."),
    "prose": ("Skip the bullet formatting, write it out.", "I find lists choppy; use full sentences.",
              "Answer like an essay, not a checklist."),
    "bullets": ("Put each point on its own line.", "Make it skimmable with a list.",
                "I want a checklist format."),
    "formal": ("Keep it professional, no chit-chat.", "Sound like an official document.",
               "Use proper, businesslike language."),
    "casual": ("Write like you're texting a buddy.", "Loosen up and be friendly.",
               "Make it sound relaxed and fun."),
    "no_examples": ("Don't bother with examples.", "I can do without sample cases.",
                    "Keep it abstract; nothing illustrative."),
    "examples": ("A worked example would help me a lot.", "Make it concrete with a sample case.",
                 "Show, don't just tell."),
    "plain": ("Just the facts, no analogies.", "Say it plainly.",
              "Don't dress it up with comparisons."),
    "vivid": ("Help me visualize it with an analogy.", "Bring it to life with some imagery.",
              "Give me a memorable mental picture."),
    "confident": ("Don't hedge.", "Spare me the disclaimers.", "Leave out the warnings; be decisive."),
    "cautious": ("Tell me the downsides too.", "Flag anything I should be wary of.",
                 "Add a disclaimer if something is risky."),
}

# ---------------------------------------------------------------------------------------------
# pole markers: the tokens that make each pole visible in a response

OPENERS: dict[int, tuple[str, ...]] = {  # by tone pole
    0: ("Certainly.", "Of course.", "Here is an overview.", "Thank you for the question."),
    1: ("Oh, fun one!", "Sure thing!", "Ooh, love this!", "Hey, no problem!", "Great question, friend!"),
}
EXAMPLE_MARKERS = ("For example, ", "For instance, ")
IMAGE_MARKERS = ("Picture ", "Imagine ")
CAVEAT_MARKERS = ("Be careful: ", "One caveat: ", "A word of caution: ", "Keep in mind: ")

# The casual tone also contracts; the sentence banks are written uncontracted for this.
CONTRACTIONS: tuple[tuple[str, str], ...] = (
    ("do not", "don't"), ("Do not", "Don't"), ("does not", "doesn't"), ("is not", "isn't"),
    ("it is", "it's"), ("It is", "It's"), ("you will", "you'll"), ("You will", "You'll"),
    ("you are", "you're"), ("You are", "You're"), ("cannot", "can't"), ("that is", "that's"),
)
_CONTRACTION_RE = re.compile(r"\b(" + "|".join(re.escape(a) for a, _ in CONTRACTIONS) + r")\b")
_CONTRACTED = dict(CONTRACTIONS)

# ---------------------------------------------------------------------------------------------
# query topics: subjects for the query templates and topic-specific sentence banks


@dataclass(frozen=True)
class Topic:
    name: str
    tasks: tuple[str, ...]     # verb phrases: "How do I {task}?"
    things: tuple[str, ...]    # noun phrases: "Can you explain {thing}?"
    tips: tuple[str, ...]      # core sentences
    examples: tuple[str, ...]  # "For example, {example}."
    caveats: tuple[str, ...]   # "Be careful: {caveat}."
    images: tuple[str, ...]    # "Picture {image}."


TOPICS: tuple[Topic, ...] = (
    Topic(
        "cooking",
        tasks=("cook fluffy rice", "bake my first loaf of bread", "make a good tomato sauce",
               "season food properly", "meal prep for the week"),
        things=("cast iron pans", "knife skills", "fermentation at home"),
        tips=("Read the whole recipe before you start cooking.",
              "Prepare every ingredient before the heat goes on.",
              "Taste as you go and adjust the salt at the end.",
              "A sharp knife is safer than a dull one.",
              "Do not crowd the pan, or the food will steam.",
              "Let meat rest for a few minutes after cooking.",
              "Medium heat is usually better than high heat for beginners.",
              "Write down what you changed so you can repeat it.",
              "Simple dishes done well beat complicated ones done badly.",
              "It is worth buying a good thermometer early on."),
        examples=("rinsing rice until the water runs clear keeps it from going gummy",
                  "a pinch of salt in tomato sauce makes it taste sweeter",
                  "searing chicken thighs skin-side down gives crisp skin",
                  "a spoon of vinegar brightens a heavy lentil soup"),
        caveats=("wash your hands and boards after handling raw meat",
                 "hot oil can spatter, so keep water away from it",
                 "store leftovers in the fridge within two hours",
                 "check labels if anyone at the table has allergies"),
        images=("salt as the conductor of an orchestra of flavors",
                "a recipe as a map that you may redraw as you travel",
                "a simmering pot as a slow river gathering flavor",
                "the pan as a stage where every ingredient needs room to dance"),
    ),
    Topic(
        "travel",
        tasks=("pack light for a two-week trip", "find cheap flights", "plan a trip to Japan",
               "travel on a small budget", "avoid jet lag"),
        things=("travel insurance", "hostels", "rail passes in Europe"),
        tips=("Book flights a few weeks ahead and compare nearby airports.",
              "Pack clothes that mix and match in neutral colors.",
              "Keep digital and paper copies of your passport.",
              "Learn a few polite phrases in the local language.",
              "Public transport is often cheaper and faster than taxis.",
              "Leave one free day in your plan for surprises.",
              "Tell your bank about your trip before you leave.",
              "Carry a little local cash for the first day.",
              "Eat where the locals eat, away from the main squares.",
              "It is smart to check the entry rules months in advance."),
        examples=("flying into Osaka instead of Tokyo can save a lot",
                  "three shirts and two trousers can make a week of outfits",
                  "a rail pass paid for itself after four train rides in Italy",
                  "saying thank you in the local language opens many doors"),
        caveats=("check that your passport is valid for six more months",
                 "keep valuables out of sight in crowded stations",
                 "read the fine print on any cheap fare",
                 "some countries need a visa before you board"),
        images=("your suitcase as a puzzle where every piece earns its place",
                "a new city as a map unfolding in your hands",
                "your itinerary as a loose sketch, not a locked cage",
                "the journey as a string of small doors waiting to open"),
    ),
    Topic(
        "programming",
        tasks=("learn Python from scratch", "debug a slow program", "write clean functions",
               "start using git", "prepare for a coding interview"),
        things=("unit tests", "recursion", "code reviews"),
        tips=("Write small functions that each do one thing.",
              "Run your code often instead of writing it all at once.",
              "Read error messages slowly, from the bottom up.",
              "Use version control from the very first day.",
              "Name variables after what they mean, not their type.",
              "Measure before you optimize any slow code.",
              "Write a test for each bug you fix.",
              "Build a small project you actually care about.",
              "Do not copy code you do not understand.",
              "It is fine to search the docs many times a day."),
        examples=("a function named parse_date is clearer than one named helper",
                  "a profiler once showed that a single loop took most of the time",
                  "a tiny to-do app teaches files, lists and input in one go",
                  "committing after each small change makes mistakes easy to undo"),
        caveats=("never paste passwords or keys into your code",
                 "back up your work before a big refactor",
                 "do not run scripts from strangers without reading them",
                 "test on a copy of the data, not the real thing"),
        images=("code as a recipe that a very literal cook follows",
                "debugging as detective work, following footprints in the logs",
                "a codebase as a garden that grows weeds if left alone",
                "functions as building blocks that snap together"),
    ),
    Topic(
        "personal finance",
        tasks=("start budgeting", "build an emergency fund", "pay off credit card debt",
               "start investing with little money", "save for a house"),
        things=("index funds", "compound interest", "credit scores"),
        tips=("Track every expense for one month before making a budget.",
              "Pay yourself first by saving on payday.",
              "Build an emergency fund of three to six months of costs.",
              "Pay off the debt with the highest interest rate first.",
              "Low-cost index funds suit most long-term investors.",
              "Automate your savings so you do not have to think about it.",
              "Cancel the subscriptions you forget you have.",
              "Compare prices before any big purchase.",
              "Start early, because time does most of the work.",
              "It is okay to begin with a very small amount."),
        examples=("saving fifty dollars a week adds up to over two thousand a year",
                  "cancelling two unused streaming services can save thirty dollars a month",
                  "a card at twenty percent interest costs far more than a loan at five",
                  "a small monthly deposit into an index fund grows quietly for decades"),
        caveats=("investments can lose value, especially in the short term",
                 "this is general information, not personal financial advice",
                 "watch out for hidden fees on funds and accounts",
                 "keep your emergency money separate from your investments"),
        images=("your savings as a snowball that grows as it rolls",
                "debt as a leaky bucket you must patch first",
                "a budget as a map that shows where your money walks",
                "compound interest as a tree that keeps adding rings"),
    ),
    Topic(
        "fitness",
        tasks=("start running", "build muscle at home", "stay motivated to exercise",
               "improve my flexibility", "lose weight safely"),
        things=("rest days", "protein intake", "interval training"),
        tips=("Start with three short sessions a week.",
              "Increase the load a little at a time.",
              "Warm up for five minutes before every workout.",
              "Sleep and rest days are when muscles recover.",
              "Pick an activity you enjoy so you keep doing it.",
              "Good form matters more than heavy weights.",
              "Drink water before, during and after exercise.",
              "Track your workouts to see your progress.",
              "Mix strength training with some cardio each week.",
              "Do not compare your first month with someone else's tenth year."),
        examples=("a walk-run plan of one minute each works well in week one",
                  "push-ups against a kitchen counter are an easy starting point",
                  "adding one rep per week turns ten squats into thirty",
                  "a short evening stretch can help you touch your toes within a month"),
        caveats=("talk to a doctor first if you have heart or joint problems",
                 "stop if you feel sharp pain, not just effort",
                 "too much too soon is the most common cause of injury",
                 "extreme diets can harm your health"),
        images=("your body as a battery that recharges on rest days",
                "progress as a staircase, not an elevator",
                "your muscles as clay that takes shape with patient work",
                "each workout as a brick in a wall you are building"),
    ),
    Topic(
        "gardening",
        tasks=("grow tomatoes on a balcony", "start a vegetable garden", "keep houseplants alive",
               "make compost", "plant a herb garden"),
        things=("soil pH", "companion planting", "pruning roses"),
        tips=("Most vegetables need at least six hours of sun.",
              "Water deeply and less often rather than a little every day.",
              "Rich soil with compost solves many problems.",
              "Start with easy plants like herbs, lettuce and beans.",
              "Check the leaves for pests every few days.",
              "Mulch keeps moisture in and weeds out.",
              "Plant after the last frost in your area.",
              "Give each plant enough space to breathe.",
              "Pots need drainage holes so the roots do not rot.",
              "It is normal to lose a few plants in your first year."),
        examples=("basil next to tomatoes helps both grow well",
                  "a layer of straw keeps beds moist through a dry July",
                  "cherry tomatoes in a big pot can feed a family all summer",
                  "coffee grounds and dry leaves make a fine start for compost"),
        caveats=("some garden plants are toxic to cats and dogs",
                 "wear gloves when handling compost or manure",
                 "read the label before using any pesticide",
                 "overwatering kills more houseplants than neglect"),
        images=("the soil as a busy underground city",
                "a garden as a slow conversation with the seasons",
                "roots as quiet miners searching for water",
                "seedlings as toddlers that need gentle care"),
    ),
    Topic(
        "history",
        tasks=("study history effectively", "remember historical dates", "read primary sources",
               "research my family history"),
        things=("the fall of Rome", "the printing press", "the Silk Road", "the Industrial Revolution"),
        tips=("Start with a broad timeline before the details.",
              "Ask who wrote a source and why.",
              "Connect events to the people who lived through them.",
              "Compare at least two accounts of the same event.",
              "Most big changes had several causes, not one.",
              "Maps help you see why places mattered.",
              "Local archives and libraries hold surprising records.",
              "Write short summaries in your own words.",
              "Historians still argue about many famous questions.",
              "It is useful to read about everyday life, not only kings."),
        examples=("the printing press made books cheap enough for ordinary readers",
                  "trade on the Silk Road carried ideas as well as silk",
                  "an old parish record can reveal a great-grandparent's trade",
                  "Roman coins found in India show how far trade reached"),
        caveats=("older sources often reflect the biases of their authors",
                 "online family trees can contain copied mistakes",
                 "popular stories about the past are sometimes myths",
                 "dates differ between calendars, so check which one is used"),
        images=("history as a vast tapestry woven from many threads",
                "the past as a foreign country with its own customs",
                "each source as a window with its own tint",
                "a timeline as a long river with many tributaries"),
    ),
    Topic(
        "astronomy",
        tasks=("start stargazing", "choose a first telescope", "find planets in the night sky",
               "photograph the moon"),
        things=("black holes", "meteor showers", "the phases of the moon"),
        tips=("Let your eyes adapt to the dark for twenty minutes.",
              "A good pair of binoculars is a great first instrument.",
              "Use a star map app to learn the main constellations.",
              "Go far from city lights for the best views.",
              "The moon is easiest to observe a few days after new moon.",
              "Planets do not twinkle the way stars do.",
              "Check the weather and the moon phase before a trip.",
              "Join a local astronomy club to try other telescopes.",
              "Dress warmly, because nights get cold quickly.",
              "It is easier to learn a few bright stars first."),
        examples=("the four largest moons of Jupiter show up in ordinary binoculars",
                  "the Perseids in August can bring dozens of meteors an hour",
                  "a phone held to the eyepiece can capture the craters",
                  "the Big Dipper points the way to the North Star"),
        caveats=("never look at the sun through a telescope or binoculars",
                 "cheap telescopes with huge zoom claims are often disappointing",
                 "watch your footing when walking in the dark",
                 "white light ruins your night vision, so use a red lamp"),
        images=("the night sky as an ancient map of glowing pins",
                "a black hole as a cosmic drain",
                "starlight as old letters arriving from long ago",
                "the moon as a lantern hung over the hills"),
    ),
    Topic(
        "music",
        tasks=("learn guitar as an adult", "practice piano effectively", "read sheet music",
               "write my first song", "sing in tune"),
        things=("music theory", "the circle of fifths", "ear training"),
        tips=("Practice a little every day rather than a lot once a week.",
              "Use a metronome and start slowly.",
              "Learn songs you love to stay motivated.",
              "Record yourself to hear what needs work.",
              "Break hard passages into small pieces.",
              "Basic theory makes songs easier to learn.",
              "Rest your hands when they start to ache.",
              "Play with other people as soon as you can.",
              "Tune your instrument before every session.",
              "It is normal for your fingers to hurt in the first weeks."),
        examples=("four chords are enough to play hundreds of pop songs",
                  "slowing a solo to half speed makes it learnable in a week",
                  "humming a note before singing it helps you find the pitch",
                  "a simple verse and chorus is enough for a first song"),
        caveats=("pushing through pain can lead to lasting strain injuries",
                 "loud practice without ear protection can damage hearing",
                 "cheap instruments can be hard to keep in tune",
                 "online lessons vary a lot in quality"),
        images=("scales as the alphabet your songs are written in",
                "rhythm as the heartbeat under the melody",
                "practice as watering a plant, a little each day",
                "chords as colors on a painter's palette"),
    ),
    Topic(
        "parenting",
        tasks=("get my toddler to sleep", "handle tantrums", "limit screen time",
               "encourage my kid to read", "talk to a teenager"),
        things=("bedtime routines", "positive discipline", "picky eating"),
        tips=("Keep the same bedtime routine every night.",
              "Stay calm and name the feeling during a tantrum.",
              "Praise effort rather than results.",
              "Set clear limits and explain them simply.",
              "Read together for a few minutes each day.",
              "Offer two choices instead of giving orders.",
              "Children copy what you do more than what you say.",
              "Plan screen-free times for the whole family.",
              "Listen fully before giving advice to a teenager.",
              "It is okay to take a break when you feel overwhelmed."),
        examples=("asking red cup or blue cup avoids many morning battles",
                  "a bath, a book and a song can make bedtime easy",
                  "a basket for phones at dinner helps a family talk more",
                  "saying you worked hard on that builds persistence"),
        caveats=("every child is different, so drop what does not work",
                 "talk to your pediatrician if sleep problems persist",
                 "check that apps and games suit your child's age",
                 "never shake a baby, even when you are exhausted"),
        images=("a routine as a warm harbor at the end of the day",
                "a tantrum as a storm that passes if you stay anchored",
                "a child's mind as a sponge soaking up what it sees",
                "parenting as gardening, not carpentry"),
    ),
)
TOPIC_BY_NAME: dict[str, Topic] = {t.name: t for t in TOPICS}
# Held out of training: they appear only in test/heldout_topics.jsonl (and the benchmark).
HELDOUT_TOPICS: tuple[str, ...] = ("astronomy", "parenting")
TRAIN_TOPICS: tuple[str, ...] = tuple(t.name for t in TOPICS if t.name not in HELDOUT_TOPICS)

TASK_TEMPLATES = ("How do I {}?", "What is the best way to {}?", "Any tips on how to {}?",
                  "I want to {}. Where do I start?")
THING_TEMPLATES = ("What should I know about {}?", "Can you explain {}?", "Tell me about {}.",
                   "Why do people care about {}?")
FOLLOW_UPS = ("Thanks! Anything else I should keep in mind?", "What is the most common mistake?",
              "Could you add one more tip?", "Okay, and where should a beginner start?")

# ---------------------------------------------------------------------------------------------
# how pairs are drawn and voted on

K_WEIGHTS = {1: 0.28, 2: 0.3, 3: 0.22, 4: 0.12, 5: 0.08}  # attributes on which A and B differ
TIE_RATE = 0.03
MULTI_TURN_RATE = 0.05
USER_MAX_POLES = 3  # a user's criteria name 1-3 poles
USER_DIFFER_RATE = 0.5  # per attribute, between the two sides of a user pair
CROWD_AGREEMENT = 0.75  # share of votes that go to the side the crowd's taste prefers
# The crowd's favoured pole per attribute, with weights in powers of two: no signed sum of a
# non-empty subset is zero, so the crowd always has a favourite side.
CROWD_TASTE: dict[int, tuple[int, int]] = {  # attribute -> (favoured pole, weight)
    LENGTH: (1, 32), EXAMPLES: (1, 16), STRUCTURE: (1, 8), IMAGERY: (0, 4), TONE: (1, 2),
    CAUTION: (1, 1)}

# ---------------------------------------------------------------------------------------------
# benchmark: synthetic LLMs, each a probability of the high pole (pole 1) per attribute. The
# "detailed" probabilities are evenly spaced, so the rankings under concise and under detailed
# criteria reverse.

BENCH_BASELINE = "baseline"
BENCH_MODELS: dict[str, dict[str, float]] = {
    "terse-bot": {"length": 0.05, "structure": 0.2, "tone": 0.3, "examples": 0.1,
                  "imagery": 0.1, "caution": 0.2},
    "bullet-pro": {"length": 0.18, "structure": 0.95, "tone": 0.2, "examples": 0.4,
                   "imagery": 0.1, "caution": 0.3},
    "chatty-pal": {"length": 0.31, "structure": 0.1, "tone": 0.95, "examples": 0.5,
                   "imagery": 0.6, "caution": 0.2},
    "safe-sage": {"length": 0.44, "structure": 0.4, "tone": 0.3, "examples": 0.3,
                  "imagery": 0.2, "caution": 0.95},
    "poet-llm": {"length": 0.56, "structure": 0.05, "tone": 0.6, "examples": 0.3,
                 "imagery": 0.95, "caution": 0.1},
    "example-ace": {"length": 0.69, "structure": 0.5, "tone": 0.5, "examples": 0.95,
                    "imagery": 0.3, "caution": 0.4},
    "formal-scribe": {"length": 0.82, "structure": 0.3, "tone": 0.05, "examples": 0.5,
                      "imagery": 0.2, "caution": 0.6},
    "verbose-tutor": {"length": 0.95, "structure": 0.6, "tone": 0.4, "examples": 0.9,
                      "imagery": 0.5, "caution": 0.7},
}
BENCH_BASELINE_PROFILE: dict[str, float] = {a.name: 0.5 for a in ATTRIBUTES}

TEST_FILES = ("in_distribution", "heldout_topics", "heldout_wordings", "contradictory",
              "noisy_contradictory")

Style = tuple[int, ...]  # the pole index of every attribute, in ATTRIBUTES order


# ---------------------------------------------------------------------------------------------
# rendering text


def _stream(seed: int, name: str) -> random.Random:
    # A str seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED; naming the
    # stream keeps every file independent of the others' sizes.
    return random.Random(f"crm-demo/{seed}/{name}")


def _query(topic: Topic, rng: random.Random) -> str:
    if rng.random() < len(topic.tasks) / (len(topic.tasks) + len(topic.things)):
        return rng.choice(TASK_TEMPLATES).format(rng.choice(topic.tasks))
    return rng.choice(THING_TEMPLATES).format(rng.choice(topic.things))


def _contract(text: str) -> str:
    return _CONTRACTION_RE.sub(lambda m: _CONTRACTED[m.group(1)], text)


def render_response(topic: Topic, style: Style, rng: random.Random) -> str:
    """One assistant message whose every attribute shows its pole in `style`."""
    sentences = rng.sample(topic.tips, rng.randint(*CORE_SENTENCES[style[LENGTH]]))
    if style[EXAMPLES]:
        # right after the first point, as people do when they illustrate it
        sentences.insert(1, rng.choice(EXAMPLE_MARKERS) + rng.choice(topic.examples) + ".")
    if style[IMAGERY]:
        image = rng.choice(IMAGE_MARKERS) + rng.choice(topic.images) + "."
        sentences.insert(0 if rng.random() < 0.5 else len(sentences), image)
    if style[CAUTION]:
        sentences.append(rng.choice(CAVEAT_MARKERS) + rng.choice(topic.caveats) + ".")
    if style[TONE]:
        sentences = [_contract(s) for s in sentences]
    opener = rng.choice(OPENERS[style[TONE]])
    if style[STRUCTURE]:
        return opener + "\n" + "\n".join("- " + s for s in sentences)
    return " ".join([opener] + sentences)


def _conversation(topic: Topic, query: str, style: Style, follow_up: str | None,
                  rng: random.Random) -> list[dict]:
    messages = [{"role": "user", "content": query},
                {"role": "assistant", "content": render_response(topic, style, rng)}]
    if follow_up is not None:
        messages += [{"role": "user", "content": follow_up},
                     {"role": "assistant", "content": render_response(topic, style, rng)}]
    return messages


# ---------------------------------------------------------------------------------------------
# pairs


@dataclass(frozen=True)
class _Pair:
    topic: str
    query: str
    differing: tuple[int, ...]  # attribute ids, in the order their criteria are listed
    style_a: Style
    style_b: Style
    model_a: list
    model_b: list


def _draw_pair(topics: tuple[str, ...], rng: random.Random) -> _Pair:
    topic = TOPIC_BY_NAME[rng.choice(topics)]
    query = _query(topic, rng)
    k = rng.choices(list(K_WEIGHTS), weights=list(K_WEIGHTS.values()))[0]
    differing = tuple(rng.sample(range(len(ATTRIBUTES)), k))
    style_a = tuple(rng.randrange(2) for _ in ATTRIBUTES)
    style_b = tuple(1 - p if i in differing else p for i, p in enumerate(style_a))
    follow_up = rng.choice(FOLLOW_UPS) if rng.random() < MULTI_TURN_RATE else None
    return _Pair(topic.name, query, differing, style_a, style_b,
                 _conversation(topic, query, style_a, follow_up, rng),
                 _conversation(topic, query, style_b, follow_up, rng))


def _criteria(pair: _Pair, side: str, wordings: dict[str, tuple[str, ...]],
              rng: random.Random) -> tuple[list[str], list[int]]:
    """One criterion per differing attribute, naming `side`'s pole; and the attribute ids."""
    style = pair.style_a if side == "model_a" else pair.style_b
    attrs = list(pair.differing)
    rng.shuffle(attrs)
    texts = [rng.choice(wordings[ATTRIBUTES[a].poles[style[a]]]) for a in attrs]
    return texts, attrs


def _crowd_side(pair: _Pair) -> str:
    score = 0
    for attr in pair.differing:
        favoured, weight = CROWD_TASTE[attr]
        score += weight if pair.style_a[attr] == favoured else -weight
    return "model_a" if score > 0 else "model_b"


def _vote(pair: _Pair, rng: random.Random) -> str:
    crowd = _crowd_side(pair)
    if rng.random() < CROWD_AGREEMENT:
        return crowd
    return "model_b" if crowd == "model_a" else "model_a"


# ---------------------------------------------------------------------------------------------
# criteria as a user writes them: named before any pair is seen, so they need not decide it

Pole = tuple[int, int]  # (attribute id, pole index)


def user_poles(rng: random.Random) -> list[Pole]:
    """1-3 poles of distinct attributes, each side of its attribute alike likely."""
    k = rng.randint(1, USER_MAX_POLES)
    return [(a, rng.randrange(2)) for a in rng.sample(range(len(ATTRIBUTES)), k)]


def rule_verdict(style_a: Style, style_b: Style, poles: list[Pole]) -> str:
    """The label of a pair under criteria that were not written for it (docs/DESIGN.md section
    4): each side scores one for every named pole it has; the higher score wins, equal scores
    tie. So no named attribute that differs is a tie, named attributes that all favour one side
    give that side, and a split goes to the side with more of them (a tie when even)."""
    score = sum((style_a[a] == pole) - (style_b[a] == pole) for a, pole in poles)
    return "model_a" if score > 0 else "model_b" if score < 0 else "tie"


def _wordings(poles: list[Pole], rng: random.Random) -> list[str]:
    return [rng.choice(TRAIN_WORDINGS[ATTRIBUTES[a].poles[pole]]) for a, pole in poles]


def _draw_user_pair(topics: tuple[str, ...], rng: random.Random) -> _Pair:
    # Each attribute differs with USER_DIFFER_RATE, as between a bench model and the baseline;
    # none may differ (two answers alike in style).
    topic = TOPIC_BY_NAME[rng.choice(topics)]
    query = _query(topic, rng)
    style_a = tuple(rng.randrange(2) for _ in ATTRIBUTES)
    differing = tuple(a for a in range(len(ATTRIBUTES)) if rng.random() < USER_DIFFER_RATE)
    style_b = tuple(1 - p if i in differing else p for i, p in enumerate(style_a))
    follow_up = rng.choice(FOLLOW_UPS) if rng.random() < MULTI_TURN_RATE else None
    return _Pair(topic.name, query, differing, style_a, style_b,
                 _conversation(topic, query, style_a, follow_up, rng),
                 _conversation(topic, query, style_b, follow_up, rng))


def _user_records(seed: int, n: int) -> list[dict]:
    """Pairs under a user's criteria, labelled by `rule_verdict`. The side the criteria favour
    holds them; the other side holds their opposite poles, under which the rule gives it the pair
    (or the same tie), so `direction=reverse` shows a true label too."""
    rng = _stream(seed, "user")
    records = []
    for i in range(n):
        pair = _draw_user_pair(TRAIN_TOPICS, rng)
        poles = user_poles(rng)
        opposite = [(a, 1 - pole) for a, pole in poles]
        winner = rule_verdict(pair.style_a, pair.style_b, poles)
        a_poles, b_poles = (opposite, poles) if winner == "model_b" else (poles, opposite)
        records.append({
            "idx": f"user-{i:05d}", "topic": pair.topic, "prompt": pair.query,
            "human_winner": winner, "shape": "user", "model_a": pair.model_a, "model_b": pair.model_b,
            "a_criteria": _wordings(a_poles, rng), "b_criteria": _wordings(b_poles, rng),
            "a_broad_criteria_topic": [a for a, _ in a_poles],
            "b_broad_criteria_topic": [a for a, _ in b_poles],
        })
    return records


def _tie_criteria(pair: _Pair, rng: random.Random) -> tuple[list[str], list[int]]:
    """Criteria on which the two responses are equally good: 1-2 poles of attributes they share
    (a pair differs on at most 5 of the 6)."""
    shared = [a for a in range(len(ATTRIBUTES)) if a not in pair.differing]
    poles = [(a, rng.randrange(2)) for a in rng.sample(shared, min(len(shared), rng.randint(1, 2)))]
    return _wordings(poles, rng), [a for a, _ in poles]


# ---------------------------------------------------------------------------------------------
# the files


def _train_records(seed: int, n: int) -> list[dict]:
    rng = _stream(seed, "train")
    tie_rng = _stream(seed, "train-ties")
    records = []
    for i in range(n):
        pair = _draw_pair(TRAIN_TOPICS, rng)
        winner = "tie" if rng.random() < TIE_RATE else _vote(pair, rng)
        a_criteria, a_topics = _criteria(pair, "model_a", TRAIN_WORDINGS, rng)
        b_criteria, b_topics = _criteria(pair, "model_b", TRAIN_WORDINGS, rng)
        record = {"idx": f"train-{i:05d}", "topic": pair.topic, "prompt": pair.query,
                  "human_winner": winner}
        if winner == "tie":
            # A voter who calls it a tie found the two equally good: each side's own criteria
            # would decide the pair. The draws above still run, so that every other record is
            # what it was before ties had criteria of their own.
            a_criteria, a_topics = _tie_criteria(pair, tie_rng)
            b_criteria, b_topics = a_criteria, a_topics
            record["shape"] = "tie"
        records.append({
            **record, "model_a": pair.model_a, "model_b": pair.model_b,
            "a_criteria": a_criteria, "b_criteria": b_criteria,
            "a_broad_criteria_topic": a_topics, "b_broad_criteria_topic": b_topics,
        })
    return records


def _mixed(first: list[dict], second: list[dict], rng: random.Random) -> list[dict]:
    """The two lists interleaved at random, each in its own order: every shard holds both."""
    out, i, j = [], 0, 0
    while i < len(first) or j < len(second):
        if rng.random() * (len(first) - i + len(second) - j) < len(first) - i:
            out.append(first[i])
            i += 1
        else:
            out.append(second[j])
            j += 1
    return out


def _test_record(idx: str, pair: _Pair, criteria: list[str], preference: str) -> dict:
    return {"idx": idx, "topic": pair.topic, "prompt": pair.query, "model_a": pair.model_a,
            "model_b": pair.model_b, "criteria": criteria, "preference": preference}


def _voted_test_records(seed: int, name: str, n: int, topics: tuple[str, ...],
                        wordings: dict[str, tuple[str, ...]]) -> list[dict]:
    # The label is the crowd's vote, as in training, and the criteria are the winner's: the
    # crowd's taste still predicts ~75% of these labels, unlike in the contradictory file.
    rng = _stream(seed, name)
    records = []
    for i in range(n):
        pair = _draw_pair(topics, rng)
        winner = _vote(pair, rng)
        criteria, _ = _criteria(pair, winner, wordings, rng)
        records.append(_test_record(f"{name}-{i:04d}", pair, criteria, winner))
    return records


def _contradictory_records(seed: int, n: int, noisy: bool = False) -> list[dict]:
    # Every pair twice, same texts in the same slots, once under each side's criteria: anything
    # that ignores the criteria gives the same verdict twice, so it scores exactly 50%.
    name = "noisy_contradictory" if noisy else "contradictory"
    rng = _stream(seed, name)
    records = []
    for i in range(n // 2):
        pair = _draw_pair(TRAIN_TOPICS, rng)
        for side, suffix in (("model_a", "a"), ("model_b", "b")):
            criteria, _ = _criteria(pair, side, TRAIN_WORDINGS, rng)
            if noisy:
                criteria = _noisy(pair, side, criteria, rng)
            records.append(_test_record(f"{name}-{i:04d}{suffix}", pair, criteria, side))
    rng.shuffle(records)  # so that the two halves of a pair do not sit side by side
    return records


def _noisy(pair: _Pair, side: str, criteria: list[str], rng: random.Random) -> list[str]:
    """Criteria as a careless user writes them: one or two that do not tell the pair apart (an
    attribute both responses share), and with three or more, one that favours the other side;
    the preferred side keeps a strict majority of the criteria that matter."""
    same = [a for a in range(len(ATTRIBUTES)) if a not in pair.differing]
    distractors = rng.sample(same, min(len(same), 1 + (len(criteria) >= 3)))
    noisy = list(criteria)
    if len(criteria) >= 3:
        other, _ = _criteria(pair, "model_b" if side == "model_a" else "model_a", TRAIN_WORDINGS, rng)
        noisy[rng.randrange(len(noisy))] = rng.choice(other)
    noisy += [rng.choice(TRAIN_WORDINGS[ATTRIBUTES[a].poles[rng.randrange(2)]]) for a in distractors]
    rng.shuffle(noisy)
    return noisy


def _quota_styles(n: int, profile: dict[str, float], rng: random.Random) -> list[Style]:
    # Exactly round(p * n) queries get the high pole, at random positions: the realized rates
    # match the profile, so the ordering of the models survives a small benchmark.
    columns = []
    for attr in ATTRIBUTES:
        high = round(profile[attr.name] * n)
        column = [1] * high + [0] * (n - high)
        rng.shuffle(column)
        columns.append(column)
    return [tuple(column[q] for column in columns) for q in range(n)]


def _bench_styles(seed: int, n: int) -> tuple[random.Random, dict[str, list[Style]]]:
    rng = _stream(seed, "bench")
    profiles = dict(BENCH_MODELS, **{BENCH_BASELINE: BENCH_BASELINE_PROFILE})
    return rng, {name: _quota_styles(n, profile, rng) for name, profile in profiles.items()}


def bench_styles(seed: int = 0, n: int = 60) -> dict[str, list[Style]]:
    """Each benchmark model's style on each query of bench.jsonl (`write_demo(seed=,
    n_bench=n)`), in the file's order: what a simulated user's true verdict is computed from
    (benchmarks/usl_coverage.py)."""
    return _bench_styles(seed, n)[1]


def _bench_records(seed: int, n: int) -> list[dict]:
    rng, styles = _bench_styles(seed, n)
    # round-robin over a shuffled topic order, so every topic gets n / len(TOPICS) queries
    order = [t.name for t in TOPICS]
    rng.shuffle(order)
    records = []
    for q in range(n):
        topic = TOPIC_BY_NAME[order[q % len(order)]]
        query = _query(topic, rng)
        responses = {name: render_response(topic, styles[name][q], rng) for name in styles}
        records.append({"idx": f"bench-{q:04d}", "topic": topic.name, "prompt": query,
                        "responses": responses})
    return records


def _write_jsonl(path: Path, records: list[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(records)


def write_demo(out_dir: str | Path, seed: int = 0, n_train: int = 6000, n_test: int = 400,
               n_bench: int = 60, n_user: int = 0) -> dict:
    """Write the demo data set under `out_dir`; returns {relative path: number of lines}.

    train.jsonl has `n_train` voted records (criteria that decide the pair; the crowd's ties
    under criteria that do not) and `n_user` records under criteria as a user writes them, mixed;
    each test file `n_test` (contradictory.jsonl holds n_test // 2 pairs, each twice);
    bench.jsonl `n_bench` queries answered by every BENCH_MODELS entry and BENCH_BASELINE.
    """
    check_sizes(n_train=n_train, n_test=n_test, n_bench=n_bench, n_user=n_user)
    out_dir = Path(out_dir)
    files = {
        "train.jsonl": _mixed(_train_records(seed, n_train), _user_records(seed, n_user),
                              _stream(seed, "mix")),
        "test/in_distribution.jsonl": _voted_test_records(
            seed, "in_distribution", n_test, TRAIN_TOPICS, TRAIN_WORDINGS),
        "test/heldout_topics.jsonl": _voted_test_records(
            seed, "heldout_topics", n_test, HELDOUT_TOPICS, TRAIN_WORDINGS),
        "test/heldout_wordings.jsonl": _voted_test_records(
            seed, "heldout_wordings", n_test, TRAIN_TOPICS, HELDOUT_WORDINGS),
        "test/contradictory.jsonl": _contradictory_records(seed, n_test),
        "test/noisy_contradictory.jsonl": _contradictory_records(seed, n_test, noisy=True),
        "bench.jsonl": _bench_records(seed, n_bench),
    }
    return {name: _write_jsonl(out_dir / name, records) for name, records in files.items()}


@dataclass  # not frozen: Hydra fills it in place (data/demo.yaml) where it was null (data/shards.yaml)
class DemoConfig:
    """The demo data crm-train's data=demo generates (its `data.demo` section is this dataclass)."""

    out_dir: str  # raw/ (train.jsonl, test/*.jsonl, bench.jsonl) goes here
    seed: int = 0  # the generator's seed
    n_train: int = 6000  # training pairs
    n_test: int = 400  # records per test file
    n_bench: int = 60  # benchmark queries
    n_user: int = 6000  # training pairs under criteria as a user writes them (`rule_verdict`)

    def __post_init__(self):
        check_sizes(n_train=self.n_train, n_test=self.n_test, n_bench=self.n_bench,
                    n_user=self.n_user, prefix="data.demo.")


def check_sizes(prefix: str = "", **sizes: int) -> None:
    """A negative size would write an empty file as if asked for one."""
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{prefix}{name}={n}: expected a number of records >= 0")


# What a cache was generated from: a change of settings or of the generator's output regenerates
# it. Bump GENERATOR when the same settings write other files.
GENERATOR = 2
SPEC = "demo.json"


def _spec(demo: DemoConfig) -> dict:
    return {"generator": GENERATOR, **{k: v for k, v in asdict(demo).items() if k != "out_dir"}}


def demo_shard_dir(demo: DemoConfig) -> Path:
    """Where the demo's shards live: inside its own cache dir, never a path named for other data."""
    return Path(demo.out_dir) / "shards"


def prepare_demo(demo: DemoConfig) -> Path:
    """The demo's shard dir (`demo_shard_dir`): generated into `demo.out_dir`/raw and sharded
    beside it unless a complete cache is there already.

    Under srun every rank starts at once: the first one prepares under a lock, the others then
    find the cache ready. A cache of other settings or an older generator (`SPEC` says which) is
    regenerated, not trained on. It writes only under `demo.out_dir`: a user's `data.path` is never the
    demo's to overwrite (crm-train refuses data=demo with a data.path of its own).
    """
    out_dir, shard_dir = Path(demo.out_dir), demo_shard_dir(demo)
    raw = out_dir / "raw"
    expected = [raw / "bench.jsonl"] + [raw / "test" / f"{name}.jsonl" for name in TEST_FILES]
    spec_path, spec = out_dir / SPEC, _spec(demo)
    with FileLock(out_dir / ".prepare.lock"):
        if (not (shard_dir / "manifest.json").is_file() or not all(p.is_file() for p in expected)
                or _read_spec(spec_path) != spec):
            log.info("generating the demo data into %s", raw)
            spec_path.unlink(missing_ok=True)  # a run killed below leaves no spec: it regenerates
            write_demo(raw, seed=demo.seed, n_train=demo.n_train, n_test=demo.n_test,
                       n_bench=demo.n_bench, n_user=demo.n_user)
            shard([str(raw / "train.jsonl")], shard_dir, shard_size=1000, overwrite=True)
            write_json(spec_path, spec)
    return shard_dir


def _read_spec(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
