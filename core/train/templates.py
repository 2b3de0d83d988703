"""Prompts generated from hand-written templates x topics, in the eight MT-bench categories.

Every prompt's `group` is its topic, so a held-out topic never appears in training under
another template.
"""

from __future__ import annotations

import random

from core.train.prompt import Prompt

TOPICS = {
    "writing": ["a rainy morning in a small town", "the first day at a new job", "a lost dog finding its way home",
                "climate change", "a trip to Japan", "learning to play the piano", "a lighthouse keeper",
                "the importance of sleep", "remote work", "a robot who wants to paint", "friendship",
                "an old library", "moving to a new city", "the ocean at night", "a childhood memory",
                "a failed experiment", "autumn leaves", "a busy train station", "a local farmers market",
                "the value of failure", "a mountain hike", "a time capsule", "the last bookstore in town",
                "a surprise birthday party", "city gardens", "a letter from the future", "a winter storm",
                "a street musician", "the smell of fresh bread", "a forgotten island", "a new smartphone",
                "volunteering at an animal shelter", "the history of coffee", "a chess tournament",
                "a family recipe", "the night sky", "electric cars", "a marathon", "a haunted house",
                "a quiet village", "public libraries", "a science fair", "space tourism", "a bakery",
                "an unexpected phone call", "a road trip", "bees and pollination", "a wedding", "kindness"],
    "roleplay": ["a pirate captain", "a medieval knight", "a travel agent", "a detective in 1920s London",
                 "a friendly librarian", "a strict chef", "a fitness coach", "a tour guide in Rome",
                 "an astronaut on Mars", "a customer support agent", "a wise old wizard",
                 "a nervous job candidate", "a museum curator", "a sports commentator", "a time traveler",
                 "a career counselor", "a shopkeeper in a fantasy village", "a news reporter",
                 "a ship's navigator", "a park ranger", "a stand-up comedian", "a startup founder",
                 "a language tutor", "a pediatric nurse", "a famous painter", "a robot butler",
                 "a radio DJ", "a gardener", "a math teacher", "a zoo keeper", "a lawyer", "a barista",
                 "a ghost in an old castle", "a mountain guide", "a film director", "a science teacher"],
    "reasoning": ["three friends sharing a pizza", "a train leaving at noon", "a family with four children",
                  "a race between five runners", "boxes of apples and oranges", "a clock that runs slow",
                  "a farmer with chickens and cows", "a bookshelf with ten books", "people standing in a line",
                  "a tournament of eight teams", "a bag of red and blue marbles", "two people's ages",
                  "a week of weather forecasts", "a code hidden in a riddle", "colored hats on prisoners",
                  "a liar and a truth-teller", "a birthday party seating plan", "a river crossing puzzle",
                  "a set of light switches", "a calendar puzzle", "coins on a table", "a relay race",
                  "a library schedule", "an elevator in a tall building", "a chess board", "a parking lot",
                  "a shop discount", "a staircase", "a school timetable", "a queue at the bank"],
    "math": ["fractions", "percentages", "prime numbers", "the area of a circle", "simple interest",
             "compound interest", "linear equations", "quadratic equations", "averages", "probability of dice",
             "the Pythagorean theorem", "ratios", "speed and distance", "the volume of a cylinder",
             "arithmetic sequences", "geometric sequences", "factorials", "greatest common divisors",
             "least common multiples", "unit conversion", "angles in a triangle", "logarithms",
             "derivatives", "integrals", "matrices", "binary numbers", "square roots", "exponents",
             "the perimeter of a rectangle", "combinations", "permutations", "statistics median and mode"],
    "coding": ["reversing a string", "checking for palindromes", "binary search", "FizzBuzz",
               "merging two sorted lists", "counting word frequencies", "reading a CSV file",
               "a stack class", "a queue class", "computing Fibonacci numbers", "removing duplicates from a list",
               "sorting a dictionary by value", "parsing JSON", "validating an email address",
               "finding the largest element", "matrix multiplication", "a linked list", "bubble sort",
               "quicksort", "a simple HTTP request", "recursion", "list comprehensions", "exceptions",
               "a decorator", "a generator", "unit tests", "SQL joins", "a REST API endpoint",
               "regular expressions", "string formatting", "a binary tree", "depth-first search",
               "breadth-first search", "memoization", "command-line arguments", "file handling"],
    "extraction": ["a product review", "a news article about a new bridge", "a restaurant menu",
                   "a job posting", "a meeting transcript", "an email from a customer", "a weather report",
                   "a recipe", "a movie synopsis", "a company announcement", "a travel itinerary",
                   "a sports match report", "a scientific abstract", "a real estate listing",
                   "a school newsletter", "an invoice", "a press release", "a flight confirmation",
                   "a book description", "a hotel review", "a doctor's appointment note", "an event flyer"],
    "stem": ["photosynthesis", "black holes", "DNA replication", "the water cycle", "plate tectonics",
             "Newton's laws of motion", "electric circuits", "the immune system", "quantum entanglement",
             "the greenhouse effect", "vaccines", "semiconductors", "the periodic table", "evolution",
             "neural networks", "the speed of light", "chemical bonds", "volcanoes", "antibiotics",
             "renewable energy", "the human heart", "gravity", "climate models", "batteries", "magnetism",
             "cell division", "sound waves", "the Big Bang", "machine learning", "encryption", "enzymes",
             "ocean currents", "nuclear fusion", "GPS satellites", "the nervous system", "rainbows"],
    "humanities": ["the French Revolution", "the Renaissance", "ancient Rome", "the printing press",
                   "the Industrial Revolution", "democracy in ancient Athens", "the Silk Road",
                   "impressionist painting", "Shakespeare's plays", "the Cold War", "existentialism",
                   "the Roman Empire's fall", "the Enlightenment", "world religions", "the Great Depression",
                   "the civil rights movement", "Greek mythology", "supply and demand", "inflation",
                   "the role of museums", "utilitarianism", "the Magna Carta", "jazz music",
                   "the history of the internet", "the Olympic Games", "ancient Egypt", "the Byzantine Empire",
                   "social media and society", "the ethics of AI", "the Meiji Restoration", "classical music",
                   "urbanization", "human rights", "the Protestant Reformation", "the history of writing"],
}

TEMPLATES = {
    "writing": ["Write a short story about {t}.", "Write a blog post about {t}.",
                "Write a poem about {t}.", "Write a persuasive essay about {t}.",
                "Write a diary entry about {t}.", "Write a short speech about {t}.",
                "Describe {t} in vivid detail.", "Write a product description inspired by {t}.",
                "Write an email to a friend about {t}.", "Write a haiku and a short explanation about {t}."],
    "roleplay": ["Pretend you are {t}. Introduce yourself and describe your typical day.",
                 "Act as {t}. A visitor asks you for advice. What do you say?",
                 "You are {t}. Tell me about the biggest challenge in your work.",
                 "Role-play as {t} and explain your job to a child.",
                 "Imagine you are {t}. Write a letter to your younger self.",
                 "As {t}, give me three tips for a beginner."],
    "reasoning": ["Make up a logic puzzle about {t} and solve it step by step.",
                  "Explain, step by step, how you would reason about a problem involving {t}.",
                  "Here is a scenario: {t}. What assumptions are reasonable, and what follows from them?",
                  "Create a riddle about {t}, then give the answer and explain it.",
                  "Think step by step: what could go wrong in a situation involving {t}?"],
    "math": ["Explain {t} with a worked example.", "Give me three practice problems about {t} with solutions.",
             "What is the most common mistake students make with {t}? Show an example.",
             "Explain {t} to a 12-year-old, step by step.", "Solve a word problem involving {t}, showing each step.",
             "Summarize the key formulas for {t}."],
    "coding": ["Write a Python function for {t} and explain it.", "How do I implement {t} in Python?",
               "Explain {t} and give a short code example.", "Write JavaScript code for {t}.",
               "What are common bugs when implementing {t}? Show a corrected example.",
               "Write a C function for {t}.", "Explain the time complexity of {t}."],
    "extraction": ["Invent {t}, then extract the key facts from it as a bulleted list.",
                   "Write {t} and then summarize it in two sentences.",
                   "Create {t} and extract all names, dates and numbers from it in JSON.",
                   "Write a sample of {t} and list the three most important points.",
                   "Given {t}, what questions would you ask to extract missing information? Write an example first."],
    "stem": ["Explain {t} in simple terms.", "What is {t} and why does it matter?",
             "Describe how {t} works, step by step.", "What are the main misconceptions about {t}?",
             "Write a short lesson plan about {t}.", "Compare {t} with a related concept.",
             "What are the latest ideas about {t}? Give a short overview."],
    "humanities": ["Give an overview of {t}.", "What were the causes and consequences of {t}?",
                   "Why is {t} important today?", "Explain {t} to a high school student.",
                   "Write a short essay about {t}.", "What are three key facts about {t}?",
                   "Compare two perspectives on {t}."],
}


# A second topic set (2026-12-02): new topics only, so the head sees more subjects in each
# category. `python -m core.train prompts --more` turns them into <work>/prompts_more.jsonl;
# a topic whose group hashes into the held-out split is dropped there (the held-out file
# stays as it is), and none of these repeats a topic above.
MORE_TOPICS = {
    "writing": ["a snowy cabin", "a forgotten letter", "the first snowfall", "a lighthouse storm", "a lost key",
                "a bicycle trip", "learning a new language", "a grandmother's garden", "a power outage",
                "a night market", "a broken clock", "a rooftop concert", "a school reunion", "a desert sunrise",
                "a stray cat", "working night shifts", "a museum at closing time", "an old photograph",
                "a first flight", "the end of summer", "a village festival", "a camping trip", "a dragon egg",
                "a message in a bottle", "a secret tunnel", "a crowded beach", "a hot air balloon",
                "the sound of rain", "a small bookshop cafe", "a new neighbor", "a mystery package",
                "a soccer final", "a mountain village", "a jazz club", "an abandoned train", "a kite festival",
                "a snow day", "a retirement party", "the first phone call home", "a sailing trip",
                "a talent show", "a garden pond", "a rainy weekend", "a second-hand guitar", "a lunar eclipse",
                "social media habits", "saving money", "healthy breakfast ideas", "a cooking class",
                "digital privacy", "learning to swim", "a city at dawn", "an old typewriter", "a fishing trip"],
    "roleplay": ["a spaceship engineer", "a travel blogger", "a royal chef", "a submarine captain",
                 "a veterinarian", "a high school principal", "a personal trainer", "a wedding planner",
                 "a firefighter", "a librarian in a magic school", "a mountain rescue pilot", "an archaeologist",
                 "a cruise ship captain", "a taxi driver in New York", "a medieval blacksmith", "a news anchor",
                 "a marine biologist", "a fashion designer", "an airline pilot", "a dance instructor",
                 "a video game designer", "a pharmacist", "a carpenter", "a chess grandmaster", "a beekeeper",
                 "a weather forecaster", "a tailor", "a hotel concierge", "a street food vendor",
                 "a knight's squire", "a dragon trainer", "an elf ranger", "a lighthouse keeper",
                 "a yoga teacher", "a bank teller", "a real estate agent", "a historian", "a film critic",
                 "a mail carrier", "an orchestra conductor", "a kindergarten teacher", "a farmer",
                 "a software engineer", "a personal chef", "a police officer", "a poet"],
    "reasoning": ["a broken vending machine", "four houses on a street", "a missing cookie", "a ferry schedule",
                  "a book club vote", "sharing candy fairly", "a weighing scale and coins", "a garden with rows",
                  "a secret password", "a bus route", "a mystery at a dinner party", "a class election",
                  "a soccer league table", "a water jug puzzle", "a card game", "a family tree",
                  "sorting socks in the dark", "a hotel with many rooms", "a treasure map", "a cooking timer",
                  "a group of hikers", "a spelling bee", "a painting contest", "a locked door and three keys",
                  "a chain of dominoes", "a lemonade stand", "a seating chart for a wedding",
                  "a lost wallet", "a leaking tank", "a tiled floor", "a night watchman", "a sliding puzzle",
                  "a road with traffic lights", "a bakery order", "a library fine", "a pet shop inventory"],
    "math": ["decimals", "negative numbers", "order of operations", "the area of a triangle", "mean absolute deviation",
             "simultaneous equations", "inequalities", "functions and graphs", "slope of a line",
             "the circumference of a circle", "the surface area of a cube", "rounding numbers", "place value",
             "long division", "multiplying fractions", "scientific notation", "exponential growth",
             "the binomial theorem", "vectors", "complex numbers", "trigonometry basics", "the sine rule",
             "polynomials", "factoring", "set theory", "Venn diagrams", "expected value", "standard deviation",
             "conditional probability", "limits", "the chain rule", "mental arithmetic tricks",
             "time calculations", "discounts and taxes", "currency exchange", "mixture problems"],
    "coding": ["a to-do list app", "reading a text file line by line", "a hash map", "insertion sort", "merge sort",
               "a priority queue", "Dijkstra's algorithm", "string reversal without slicing", "counting vowels",
               "anagram checking", "a calculator class", "a tic-tac-toe game", "prime number checking",
               "the sieve of Eratosthenes", "flattening a nested list", "a LRU cache", "a trie",
               "an iterator class", "context managers", "async functions", "threading basics",
               "logging setup", "environment variables", "a password generator", "a simple web scraper",
               "type hints", "dataclasses", "sorting objects by a key", "a binary search tree",
               "a matrix transpose", "rotating a list", "two-sum", "a countdown timer", "a CSV report",
               "a JSON config loader", "string compression", "a rate limiter", "a bank account class"],
    "extraction": ["a customer complaint letter", "a research paper summary", "a police report", "a phone bill",
                   "a course syllabus", "a concert review", "a product manual", "a rental agreement",
                   "a patient discharge summary", "a bus timetable", "a conference agenda", "a cover letter",
                   "a nutrition label", "a shipping notice", "a city council announcement", "a bank statement",
                   "a podcast description", "a lab report", "an insurance claim", "a museum guide",
                   "a warranty card", "a football transfer rumor", "a startup pitch", "a train delay notice",
                   "a library catalog entry", "a job interview transcript", "a school report card",
                   "a car advertisement"],
    "stem": ["earthquakes", "the solar system", "tides", "photosynthesis in algae", "the water molecule",
             "bacteria and viruses", "the carbon cycle", "wind turbines", "solar panels", "nuclear fission",
             "the theory of relativity", "atoms and molecules", "acids and bases", "the digestive system",
             "the brain", "muscles and bones", "genetics", "the ozone layer", "weather fronts", "hurricanes",
             "lasers", "transistors", "the internet's infrastructure", "3D printing", "robotics",
             "electric motors", "friction", "thermodynamics", "light refraction", "the moon's phases",
             "stars and galaxies", "exoplanets", "coral reefs", "rainforests", "soil erosion", "blood types",
             "sleep and the brain", "microscopes", "telescopes", "radioactivity"],
    "humanities": ["the American Revolution", "the Mongol Empire", "the Aztec civilization", "ancient China",
                   "the Ottoman Empire", "the Crusades", "the Black Death", "the Age of Exploration",
                   "the Russian Revolution", "World War I", "World War II", "the United Nations",
                   "the European Union", "the Harlem Renaissance", "romanticism in literature",
                   "modern architecture", "the history of cinema", "the Beatles", "stoicism",
                   "the philosophy of Plato", "Confucianism", "Buddhism", "the Vikings", "the Incas",
                   "the abolition of slavery", "women's suffrage", "globalization", "the Mughal Empire",
                   "the history of money", "the scientific revolution", "the history of medicine",
                   "opera", "the novel as a form", "free speech", "colonialism", "the welfare state",
                   "the history of the bicycle", "folk tales", "the space race"],
}


# A third topic set (2026-12-02, second session), weighted to the categories where the head
# accepts least on held-out prompts (reasoning, stem, humanities, roleplay, writing, math).
# `python -m core.train prompts --set 3` -> <work>/prompts_set3.jsonl; same rules as set 2.
THIRD_TOPICS = {
    "writing": ["a paper boat race", "a night train across Europe", "the last day of school", "a foggy harbor",
                "a runaway balloon", "a family road trip gone wrong", "a tree house", "a midnight snack",
                "a power cut during a storm", "an empty theater", "a lost umbrella", "a letter to a future child",
                "the smell of old books", "a volcano island", "a rescue dog", "a wrong turn in the forest",
                "a birthday in a hospital", "a ghost in the attic", "a spring flood", "a street art mural",
                "the first day of spring", "a long queue at the post office", "moving out of home",
                "a robot gardener", "an apple orchard", "a foreign exchange student", "a chess club",
                "a flea market find", "the quiet after a party", "an overdue library book", "a thunderstorm",
                "a grandfather's watch", "a school play", "a city bus at midnight", "a frozen lake",
                "a homemade kite", "a mountain cabin fire", "a wedding toast", "a neighborhood cleanup",
                "a space station garden", "the sound of the sea", "learning to cook", "a tiny apartment"],
    "roleplay": ["a zookeeper", "a ship's cook", "a detective in Tokyo", "a museum night guard",
                 "a wizard's apprentice", "a baker in Paris", "a ski instructor", "a sommelier",
                 "a flight attendant", "a locksmith", "a court judge", "a gardener at a palace", "a stage magician",
                 "a street painter", "a football coach", "a photographer", "a nurse on a night shift",
                 "a Roman senator", "a samurai", "a cowboy", "a tour guide in Egypt", "an ice cream seller",
                 "a diplomat", "a game show host", "a dentist", "an architect", "a cartographer",
                 "a ship navigator", "a scientist in Antarctica", "a comic book artist", "a toy maker",
                 "a village healer", "a climbing instructor", "a bus driver", "a translator", "a clockmaker",
                 "a deep-sea diver", "a hot air balloon pilot", "a florist", "a tattoo artist"],
    "reasoning": ["three friends and their pets", "a train leaving two stations", "a birthday paradox",
                  "two doors and two guards", "a shared pizza", "a clock that loses time", "a river crossing",
                  "a race between a tortoise and a hare", "ages of siblings", "a coin that might be fake",
                  "mixing paint colors", "a school timetable clash", "a staircase with missing steps",
                  "a queue at a ticket office", "a lying witness", "a parking lot puzzle", "a magic square",
                  "an elevator that stops at odd floors", "a chessboard and dominoes", "a jar of marbles",
                  "a broken calculator", "counting handshakes", "a bridge at night with one torch",
                  "a fruit basket mix-up", "a farmer, a wolf, a goat and a cabbage", "a burning rope timer",
                  "a prisoner's hat puzzle", "a light switch in another room", "a fair way to split a cake",
                  "a number sequence", "a mislabeled box", "a tournament bracket", "a snail climbing a well",
                  "a cyclist and a headwind", "a shopping list budget", "a train seat reservation",
                  "a two-egg drop problem", "a detective's alibi check", "a crossing guard's schedule",
                  "a school bus with five stops"],
    "math": ["proportions", "prime factorization", "greatest common divisor", "least common multiple",
             "the distributive property", "the quadratic formula", "similar triangles", "coordinate geometry",
             "the distance formula", "determinants", "the normal distribution", "median and mode",
             "speed, distance and time", "work rate problems", "integration by parts", "derivatives of polynomials",
             "the area under a curve", "modular arithmetic", "proof by induction", "absolute value",
             "the Fibonacci sequence", "percent change", "estimating", "Roman numerals", "the area of a trapezoid",
             "the volume of a sphere", "the volume of a cone", "box plots", "histograms", "the interquartile range",
             "the slope-intercept form", "systems of inequalities", "rational expressions", "exponential decay",
             "the unit circle", "radians", "the cosine rule", "the law of large numbers", "the birthday problem",
             "why division by zero is undefined"],
    "coding": ["a queue using two stacks", "fizzbuzz", "palindrome checking", "word counting",
               "a decorator that times a function", "a generator for Fibonacci numbers",
               "parsing command-line arguments", "reading JSON from a file", "unit tests with pytest",
               "regular expressions for emails", "a REST API client", "a memoized recursive function",
               "a simple HTTP server", "a matrix multiplication", "a binary to decimal converter",
               "validating a date string", "a shopping cart class", "a stopwatch class", "a maze solver",
               "a URL shortener", "an inventory system", "a simple chatbot", "a markdown to HTML converter",
               "a temperature converter", "a word guessing game"],
    "extraction": ["a flight itinerary", "a news article about a flood", "a doctor's appointment letter",
                   "a recipe card", "a hotel booking confirmation", "an email thread about a project",
                   "a travel insurance policy", "a job advertisement", "a parking ticket", "a lease renewal letter",
                   "a tax form summary", "a gym membership contract", "a vaccination record",
                   "a software release note", "a court summons", "a charity donation receipt",
                   "a university admission letter", "a power outage notice", "a product recall notice",
                   "a pet adoption form"],
    "stem": ["electricity and circuits", "chemical reactions", "the heart", "the lungs",
             "evolution by natural selection", "ecosystems", "food chains", "glaciers", "GPS", "quantum computing",
             "wind and air pressure", "cells and organelles", "hormones", "magnets in motors", "fossils",
             "the kidneys", "the eye and vision", "the ear and hearing", "tsunamis", "tornadoes", "lightning",
             "clouds", "snowflakes", "the Doppler effect", "buoyancy", "the human skeleton", "stem cells", "CRISPR",
             "microplastics", "desalination", "hydrogen fuel cells", "superconductors", "the Higgs boson",
             "dark matter", "comets", "asteroids", "the Sun", "Mars exploration", "water treatment", "composting",
             "bioluminescence"],
    "humanities": ["the Roman Republic", "ancient Greece", "the fall of the Berlin Wall", "the Maya civilization",
                   "feudalism", "impressionism", "Norse mythology", "democracy in Athens", "the history of jazz",
                   "the invention of the telephone", "the partition of India", "apartheid in South Africa",
                   "the Meiji era reforms", "the Persian Empire", "the Hundred Years' War",
                   "the history of chocolate", "the Great Wall of China", "the Spanish Civil War",
                   "the history of photography", "public education", "the Suez Canal", "Gothic cathedrals",
                   "the Han dynasty", "the Zulu kingdom", "the Hanseatic League", "the Irish famine",
                   "the Mexican Revolution", "the Tang dynasty", "the Khmer Empire", "the Phoenicians",
                   "the history of tea", "the Dutch Golden Age", "baroque music", "surrealism", "the Bauhaus",
                   "the history of the alphabet", "the Treaty of Versailles", "the Marshall Plan", "the gold rush",
                   "the history of universities"],
}


def templated_prompts(per_category: int, seed: int) -> list[Prompt]:
    """Up to `per_category` distinct (template, topic) prompts per category."""
    return _templated(TOPICS, per_category, seed, "tpl")


def more_templated_prompts(per_category: int, seed: int, topic_set: int = 2) -> list[Prompt]:
    """Up to `per_category` (template, topic) prompts per category from topic set 2
    (MORE_TOPICS) or 3 (THIRD_TOPICS); no set repeats a topic of an earlier one."""
    sets = {2: MORE_TOPICS, 3: THIRD_TOPICS}
    if topic_set not in sets:
        raise ValueError(f"topic set {topic_set} does not exist: choose one of {sorted(sets)}")
    earlier = [TOPICS] + [sets[n] for n in sorted(sets) if n < topic_set]
    for cat, topics in sets[topic_set].items():
        repeated = set(topics) & {t for ts in earlier for t in ts.get(cat, [])}
        assert not repeated, f"topic set {topic_set} repeats {sorted(repeated)} in {cat!r}"
    return _templated(sets[topic_set], per_category, seed, f"tpl{topic_set}")


def _templated(topic_sets: dict[str, list[str]], per_category: int, seed: int, prefix: str) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for cat, topics in topic_sets.items():
        combos = [(ti, t) for ti in range(len(TEMPLATES[cat])) for t in topics]
        rng.shuffle(combos)
        for ti, topic in combos[:per_category]:
            text = TEMPLATES[cat][ti].format(t=topic)
            out.append(Prompt(f"{prefix}-{cat}-{ti}-{_slug(topic)}", cat, (text,), group=f"{cat}:{topic}"))
    return out


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")[:40]
