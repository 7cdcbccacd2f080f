"""The default seed prompts for self-distillation, written for this project (not Spec-Bench).

Varied on purpose: chat, instructions, code, math, summaries, translation, question answering,
extraction. ``default_prompts(n, seed)`` mixes task templates with topics deterministically.
"""

from __future__ import annotations

import random

TOPICS = [
    "volcanoes", "the water cycle", "honeybees", "the printing press", "black holes", "composting",
    "the Roman aqueducts", "electric cars", "sleep", "coral reefs", "the stock market", "jazz",
    "photosynthesis", "the Silk Road", "vaccines", "recycling plastic", "the moon landing", "tea",
    "earthquakes", "machine learning", "the human heart", "bicycles", "solar panels", "chess",
    "the Great Wall of China", "bread baking", "rainforests", "the internet", "penguins", "glaciers",
    "public libraries", "the Olympic Games", "coffee", "wind turbines", "the immune system",
    "origami", "desert ecosystems", "train travel", "lighthouses", "the periodic table",
]

TASKS = [
    "Explain {t} to a curious twelve-year-old.",
    "Write a short paragraph about {t}.",
    "Give me five interesting facts about {t}.",
    "What are the pros and cons of {t}? Answer with a short list.",
    "Write a haiku about {t}.",
    "Write a short story of about 100 words that involves {t}.",
    "Summarize the history of {t} in three sentences.",
    "I am preparing a school presentation on {t}. Suggest an outline with four sections.",
    "Write a friendly tweet announcing a workshop about {t}.",
    "What is a common misconception about {t}, and what is the truth?",
    "Describe {t} in the style of a nature documentary narrator.",
    "Write three quiz questions (with answers) about {t}.",
    "Translate into French: I read a fascinating article about {t} yesterday.",
    "Translate into Spanish: My teacher told us many things about {t}.",
    "Translate into German: We spent the whole afternoon talking about {t}.",
    "How would you explain the importance of {t} to a busy manager in two sentences?",
]

STANDALONE = [
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that returns the factorial of n, with a docstring and a test.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Explain what a hash map is and give a small Python example.",
    "Write a SQL query that counts orders per customer in a table orders(customer_id, amount).",
    "What does the Python keyword 'yield' do? Give an example.",
    "Write a bash command that counts the lines of every .txt file in a folder.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function in C that returns the maximum of an array of integers.",
    "How do I read a CSV file with pandas and print its first rows?",
    "Explain recursion with a short example.",
    "What is 15% of 240? Show your steps.",
    "A train travels 180 km in 2 hours. What is its average speed?",
    "Solve for x: 3x + 7 = 22. Explain each step.",
    "If a shirt costs $25 after a 20% discount, what was the original price?",
    "What is the sum of the integers from 1 to 50?",
    "A rectangle has a perimeter of 30 cm and a width of 5 cm. What is its area?",
    "Tom has 3 times as many apples as Sara. Together they have 24. How many does each have?",
    "Convert 5 kilometers to miles and explain the conversion.",
    "What is the probability of getting two heads when flipping two fair coins?",
    "Calculate 12 * 17 step by step.",
    "Hi! How are you today?",
    "Can you recommend a good routine for a productive morning?",
    "I feel nervous before job interviews. Any advice?",
    "What should I pack for a weekend hiking trip?",
    "Tell me a joke about programmers.",
    "What are some healthy breakfast ideas?",
    "How can I improve my English vocabulary?",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "Write a polite email asking my landlord to fix a leaking tap.",
    "Write a thank-you note to a colleague who helped me with a project.",
    "Summarize: The city council met on Monday to discuss the new bike lanes. Several residents "
    "supported the plan, saying it would make streets safer, while shop owners worried about losing "
    "parking spaces. The council agreed to run a six-month trial on two streets before deciding.",
    "Summarize: A new study followed 2,000 adults for ten years and found that those who walked at "
    "least 7,000 steps a day had a lower risk of heart disease. The researchers note that the study "
    "shows a link, not a cause, and call for more trials.",
    "Summarize: The museum will close for renovation from March to September. During this time, "
    "part of its collection will travel to partner museums abroad, and an online gallery will offer "
    "virtual tours of the most famous paintings.",
    "Extract the names and dates from: Maria joined the company on 3 May 2019, and Peter followed "
    "on 12 January 2021.",
    "Classify the sentiment of this review as positive or negative: The food was cold and the "
    "waiter ignored us for twenty minutes.",
    "Rewrite this sentence to be more formal: Hey, can you send me that stuff by tomorrow?",
    "Give three synonyms for 'happy' and use each in a sentence.",
    "List the planets of the solar system in order from the sun.",
]


def default_prompts(n: int = 240, seed: int = 0) -> list[str]:
    """``n`` varied seed prompts (deterministic for a seed): every standalone prompt first, then
    task x topic combinations in a shuffled order."""
    combos = [task.format(t=topic) for task in TASKS for topic in TOPICS]
    random.Random(seed).shuffle(combos)
    return (STANDALONE + combos)[:n]
