"""The built-in `tiny` model: a small random Llama with a real byte-level BPE tokenizer.

It is made by the project, deterministically and without network access, and cached as an
ordinary Hugging Face folder (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja), so every code path that serves a
real checkpoint serves it too. The weights are random, so its text is gibberish: it exists for
the demo, the tests and CPU benchmarks.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .config import ModelConfig
from .decoder import DecoderLM, init_random_weights

TINY_DIRNAME = "tiny-v2"  # bump when the files below change
TINY_SEED = 1234
TINY_VOCAB_SIZE = 3072

BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
EOT = "<|eot_id|>"
PAD = "<|finetune_right_pad_id|>"
SPECIAL_TOKENS = (
    BOS,
    END_OF_TEXT,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT,
    "<|eom_id|>",
    "<|python_tag|>",
    PAD,
)

# Our own chat format in the Llama 3 style: each turn is a header naming the role, a blank line,
# the text and <|eot_id|>; a trailing open assistant header asks the model to answer.
CHAT_TEMPLATE = """\
{#- SuperInfer tiny chat format; tools and tool calls in the hermes style. -#}
{{- bos_token -}}
{%- if tools -%}
    {{- "<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these tools:\\n" -}}
    {%- for tool in tools -%}
        {{- tool | tojson ~ "\\n" -}}
    {%- endfor -%}
    {{- "<|eot_id|>" -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role not in ["system", "user", "assistant", "tool"] -%}
        {{- raise_exception("the tiny chat template has no role named '" ~ message.role ~ "'") -}}
    {%- endif -%}
    {%- if message.content is none -%}
        {%- set text = "" -%}
    {%- elif message.content is string -%}
        {%- set text = message.content -%}
    {%- else -%}
        {%- set text = message.content | selectattr("type", "equalto", "text")
            | map(attribute="text") | join("\\n") -%}
    {%- endif -%}
    {%- set out = namespace(text=text) -%}
    {%- for call in message.tool_calls or [] -%}
        {%- set arguments = call.function.arguments -%}
        {%- if arguments is not string -%}{%- set arguments = arguments | tojson -%}{%- endif -%}
        {%- set out.text = out.text ~ "<tool_call>\\n{\\"name\\": " ~ call.function.name | tojson
            ~ ", \\"arguments\\": " ~ arguments ~ "}\\n</tool_call>" -%}
    {%- endfor -%}
    {{- "<|start_header_id|>" ~ message.role ~ "<|end_header_id|>\\n\\n" ~ out.text | trim ~ "<|eot_id|>" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" -}}
{%- endif -%}
"""

# Written for this project: plain sentences on everyday topics, numbers, a few accented words and
# code fragments, so the BPE learns whole words, digits and multi-byte characters.
_CORPUS = """\
The harbor was quiet before dawn, and the fishing boats rocked gently against the wooden pier.
A gull landed on the railing, tilted its head, and waited for someone to drop a piece of bread.
Mara counted the crates twice because the numbers on the invoice did not match the ones on the deck.
By seven o'clock the market had opened, and the smell of fresh coffee drifted over the stalls.
Nobody could remember who had painted the lighthouse red, but everyone agreed it looked better that
way.
The old keeper still climbed the spiral stairs every evening to check the lamp and wind the clock.
When the fog rolled in, he rang the bell every thirty seconds until the last boat was safely home.
Our train left the station eleven minutes late, which the conductor blamed on a stubborn signal.
Through the window we watched fields of wheat give way to pine forests and then to grey mountains.
A child across the aisle asked her father how many tunnels there were, and he guessed fourteen.
She counted them aloud, one by one, and proudly announced that there were actually seventeen.
In the dining car, the waiter balanced four bowls of soup on a tray without spilling a single drop.
The recipe calls for two cups of flour, a pinch of salt, three eggs, and a little warm milk.
Whisk the eggs until they are pale, then fold in the flour slowly so the batter stays light.
If the dough feels sticky, dust the table with flour and knead it for another five minutes.
Bake the bread at a high temperature for the first ten minutes, then lower the heat.
A good loaf sounds hollow when you tap the bottom, and the crust should crackle as it cools.
My grandmother never measured anything; she cooked by smell, by color, and by memory.
The garden behind the school grows tomatoes, beans, carrots, and a surprising number of sunflowers.
Every spring the students plant seeds in small paper cups and label each one with a pencil.
Some seedlings grow tall and strong, while others need extra water, patience, and a sunny window.
By the end of summer, the tallest sunflower was taller than the gardener who had planted it.
Bees moved from flower to flower, heavy with pollen, humming a low and steady song.
The library opens at nine and closes at six, except on Sundays when it stays closed all day.
Its reading room has tall windows, long oak tables, and green lamps that glow in the afternoon.
A librarian once told me that the most borrowed book was a guide to repairing bicycles.
People return books with strange bookmarks inside: tickets, recipes, letters, and pressed leaves.
The river rises every April when the snow melts high in the hills above the valley.
Farmers build low walls of stone to keep the water away from their fields and barns.
In dry years the river shrinks to a thin silver thread, and children walk across it barefoot.
A bridge of iron and brick was built here more than a century ago and still carries traffic.
The computer hummed quietly while it compiled the program, line after line, file after file.
When the tests finally passed, the engineer leaned back, stretched, and made another cup of tea.
A small change in one function had broken three other modules in ways nobody expected.
Good software is written twice: once to understand the problem, and once to solve it well.
The server answered each request in a few milliseconds, even when thousands arrived at once.
Requests wait in a queue, and the scheduler decides which ones should run on the next step.
Each step processes a batch of tokens, some from new prompts and some from running answers.
Memory for the cache is divided into blocks, and every block holds the keys and values of a few
tokens.
When memory runs low, the oldest or least urgent requests may be paused and resumed later.
The first token should arrive quickly, and the following tokens should flow at a steady pace.
Latency is measured in milliseconds, throughput in tokens per second, and patience in coffee.
A model reads text as a sequence of numbers, one number for every small piece of a word.
The tokenizer splits rare words into several pieces and keeps common words as a single piece.
Some characters, such as accented letters or symbols, take more than one byte to store.
The café on the corner serves crêpes, croissants, and a very strong espresso.
In Zürich the trams run on time, and in São Paulo the traffic rarely sleeps.
A naïve plan can still work if the team is willing to adjust it along the way.
The price was 42 euros, or roughly 45 dollars, depending on the exchange rate that morning.
Temperatures reached 31 degrees at noon, then dropped to 18 degrees after the storm passed.
The marathon route is 42.195 kilometers long and winds through nine different neighborhoods.
Her phone number ended in 2048, which she said was easy to remember for a programmer.
Please call me back before 5:30 tomorrow, or send a short message if you are busy.
Why do cats sit in boxes that are clearly too small for them? Nobody really knows.
What time does the museum open on holidays? Is there a discount for students?
How far is it from the station to the hotel, and is it safe to walk there at night?
Yes, the museum opens at ten, and students pay half price if they show a valid card.
No, the hotel is not far; it takes about fifteen minutes on foot along the river.
The weather forecast promised sunshine, but the clouds had other plans for the afternoon.
Thunder rolled across the valley, and the rain fell so hard that the streets turned into streams.
After the storm, the air smelled of wet earth, and a rainbow stretched over the rooftops.
Winter arrived early that year, covering the village in snow before the leaves had fallen.
The children built a snowman with a carrot nose, two buttons, and an old striped scarf.
In the evening, families gathered around the fire to tell stories and drink hot chocolate.
A fox crossed the frozen pond at midnight, leaving a neat line of tracks behind it.
The astronomer pointed her telescope at a faint smudge of light beyond the brightest stars.
That smudge, she explained, was a galaxy whose light had traveled for millions of years.
Planets wander slowly across the sky, while the stars keep their patterns for centuries.
On clear nights you can see the moon's craters with nothing more than a pair of binoculars.
Mathematics is the art of giving the same name to different things that behave alike.
Two plus two is four, three times three is nine, and ten divided by four is two and a half.
A prime number has exactly two divisors: one and itself, like seven, eleven, or thirteen.
The square root of sixty-four is eight, and the cube of three is twenty-seven.
Every triangle has three angles, and together they always add up to one hundred eighty degrees.
The meeting started on time, but the agenda was longer than anyone had hoped.
First, the team reviewed last week's results; then they discussed the budget for next quarter.
Someone suggested a shorter meeting every day instead of a long one every week.
Everyone agreed, which was the first time that had happened in several months.
The bicycle had a flat tire, a loose chain, and a bell that only rang when it felt like it.
He fixed the tire with a patch, tightened the chain, and decided the bell had character.
Riding along the canal at sunrise, he passed joggers, dog walkers, and a sleepy heron.
The museum's newest exhibit shows tools that people used to measure time before clocks.
There are sundials, water clocks, candles marked with lines, and hourglasses of every size.
A guide explained that sailors once used knotted ropes to estimate the speed of their ships.
Thank you for your message. I will read the report carefully and reply by Friday.
Could you please send me the latest version of the document and a short summary?
I am sorry for the delay; the files were larger than expected and took a while to upload.
Let me know if anything is unclear, and I will be happy to explain it in more detail.
Sure! Here is a simple answer: start small, measure often, and change one thing at a time.
That is a great question. The short answer is yes, but the long answer depends on context.
I do not know the answer yet, but I can help you find out where to look.
Once upon a time, a tiny robot lived in a workshop full of gears, springs, and dusty shelves.
Every night it polished the tools, sorted the screws, and listened to the rain on the roof.
One morning the robot found a map hidden inside an old clock, marked with a small silver star.
It packed a flashlight, a spare battery, and a notebook, and set out to follow the map.
The journey took it over hills, through a forest, and across a river on a wobbly raft.
At the silver star it found a garden of glowing flowers that hummed when the wind blew.
The robot wrote everything in its notebook and returned home to tell the other machines.
function add(a, b) { return a + b; }
for i in range(10): print(i * i)
if value is None: raise ValueError("value must not be empty")
def greet(name): return f"Hello, {name}!"
SELECT name, price FROM products WHERE price < 100 ORDER BY price;
The list contains apples, bananas, cherries, dates, elderberries, figs, and grapes.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, and Sunday make a week.
January, February, March, April, May, June, July, August, September, October, November, December.
Red, orange, yellow, green, blue, indigo, and violet are the colors of the rainbow.
North, south, east, and west are the four directions printed on every compass.
Zero, one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Happy birthday! We hope your year is full of laughter, good friends, and quiet mornings.
Ideas grow when they are shared, questioned, tested, and shared again.
Small steps repeated every day can carry you farther than a single giant leap.
The orchestra tuned their instruments while the audience whispered and rustled their programs.
A violinist adjusted her bow, the cellist closed his eyes, and the conductor raised both hands.
Music filled the hall like warm light, and for an hour nobody checked their phones.
The volcano had been sleeping for centuries, but scientists still watched it with careful
instruments.
Sensors buried in the rock recorded tiny tremors and sent the measurements to a distant laboratory.
Geologists compared the readings with older records and concluded that nothing unusual was
happening.
Pharmacists, electricians, carpenters, plumbers, nurses, and teachers keep a town running smoothly.
The carpenter sanded the table until the grain shimmered, then sealed it with three thin coats of
oil.
An electrician rewired the kitchen, replaced the fuse box, and labeled every switch neatly.
Nurses worked overnight shifts, checking temperatures, refilling medicine, and comforting worried
patients.
The archaeologists uncovered pottery fragments, bronze coins, and the foundations of a forgotten
temple.
Each fragment was photographed, measured, cataloged, and wrapped in soft tissue before transport.
Historians argued politely about whether the temple had been abandoned because of drought or war.
Penguins huddle together through the polar winter, taking turns standing at the windy edge of the
group.
Whales migrate thousands of kilometers, singing complicated songs that change slightly every season.
Octopuses can change color in a fraction of a second and squeeze through astonishingly narrow gaps.
Elephants remember watering holes for decades and mourn companions that have passed away.
Hummingbirds beat their wings so quickly that they appear as a blur to the human eye.
The committee postponed its decision, requesting additional evidence, independent reviews, and
clearer estimates.
Negotiations continued until midnight, when both parties finally signed a cautious but reasonable
agreement.
Journalists waited outside with cameras, microphones, notebooks, and an impressive supply of
sandwiches.
Photography teaches patience: you wait for the light, the cloud, the expression, the exact moment.
A photographer knelt in the mud for an hour to capture a dragonfly resting on a reed.
Painters mix pigments with oil, egg, or water, and each medium behaves differently on canvas.
Sculptors carve marble slowly, removing everything that does not belong to the figure inside.
Architecture balances beauty, strength, comfort, and cost, and rarely satisfies all four completely.
The skyscraper swayed slightly in strong winds, exactly as its engineers had intended.
Tunnels beneath the city carry water, electricity, trains, telephone cables, and forgotten secrets.
Bakers wake before sunrise, and by breakfast their shelves are crowded with rolls, pastries, and
pies.
Cheese makers age wheels of cheese in cool caves, turning each wheel by hand every week.
Vineyards climb the sunny slopes, and harvest season brings music, laughter, and sticky purple
fingers.
The mechanic listened to the engine, frowned, and said the trouble was probably a worn belt.
Replacing the belt took twenty minutes; finding the right replacement took three days.
Airplanes cruise about eleven kilometers above the ground, where the air is thin and freezing.
Pilots follow checklists carefully, because routine protects people when surprises happen.
Astronauts exercise daily aboard the station to keep their muscles and bones from weakening.
Satellites orbit the planet, relaying weather pictures, television signals, and navigation data.
Electricity travels through copper wires, but information increasingly travels through glass fibers.
Batteries store chemical energy and release it as an electric current when a circuit is closed.
Magnets attract iron, repel each other when similar poles meet, and guide compass needles northward.
Photosynthesis converts sunlight, water, and carbon dioxide into sugar and oxygen inside green
leaves.
Volunteers cleaned the beach on Saturday, collecting bottles, nets, plastic bags, and one rubber
duck.
The neighborhood organized a festival with lanterns, dancing, storytelling, and homemade lemonade.
Grandparents shared memories of childhood games, strict teachers, long walks, and winters without
heating.
Teenagers taught the grandparents how to send photographs, record videos, and make silly stickers.
Curiosity is contagious: one good question often leads a whole classroom to a dozen more.
Scientists publish experiments so that others can repeat them, challenge them, and improve them.
Reproducibility matters because a result nobody can reproduce is merely an interesting rumor.
Statistics helps us separate genuine patterns from coincidences, though it never removes uncertainty
entirely.
Probability describes how likely something is, from impossible, through unlikely, to almost certain.
Algorithms are recipes for computers: precise steps that transform inputs into useful outputs.
Sorting, searching, hashing, caching, and scheduling appear in nearly every serious program.
Engineers profile programs to discover where time is spent before deciding what to optimize.
Premature optimization wastes effort, but ignoring performance entirely creates painful surprises
later.
Documentation explains not only how something works but also why it was designed that way.
Version control remembers every change, who made it, and the message explaining the reason.
Testing early catches mistakes while they are still cheap, small, and easy to understand.
Debugging resembles detective work: gather clues, form hypotheses, and eliminate suspects
methodically.
Keyboards, monitors, processors, memory chips, and storage drives together make a working computer.
Graphics processors perform thousands of arithmetic operations simultaneously, which suits neural
networks.
Bandwidth limits how quickly data moves, while latency measures how long the first byte takes.
Transformers attend to every previous token, weighting each one by how relevant it seems.
Embeddings map words into vectors, so that similar meanings end up near each other in space.
Normalization keeps activations within a reasonable range, which stabilizes both training and
inference.
Quantization shrinks weights into fewer bits, trading a little accuracy for speed and memory.
Gardening gloves, trowels, watering cans, wheelbarrows, and compost bins crowded the shed.
Mushrooms appeared overnight after the rain, pale and round beneath the dripping ferns.
Autumn leaves crunched underfoot, orange, crimson, golden, and brown, swirling in every gust.
Lighthouses, windmills, castles, cathedrals, and bridges attract travelers from faraway countries.
Travelers collect stamps, postcards, souvenirs, photographs, and stories they repeat for years.
Languages borrow words from one another constantly, like neighbors sharing tools across a fence.
Dictionaries record how people actually speak, not merely how grammarians wish they would.
Poetry compresses feeling into rhythm, image, and sound, leaving spaces for readers to fill.
Humor depends on timing, surprise, and a shared understanding of what would normally happen.
Kindness costs nothing, yet it remains surprisingly scarce in crowded trains and busy offices.
Honesty builds trust slowly, and a single careless lie can destroy it remarkably fast.
Wisdom often sounds simple afterward, although discovering it usually required many complicated
mistakes.
Thursday's workshop covers microphones, amplifiers, speakers, cables, mixers, and basic acoustics.
Tickets cost twelve dollars for adults, six for children, and nothing for anyone bringing a drum.
Registration closes on the twentieth, so please submit your application, photograph, and references
promptly.
The warehouse shipped forty-three parcels yesterday, mostly blankets, lamps, kettles, and umbrellas.
Customers complained that the umbrellas opened beautifully but refused to close again.
The manufacturer apologized, redesigned the hinge, and offered every customer a free replacement.
Meteorologists track hurricanes using satellites, aircraft, buoys, radar stations, and computer
simulations.
Earthquakes release energy stored when tectonic plates grind slowly past each other.
Glaciers carve valleys over thousands of years, leaving polished rocks and deep blue lakes behind.
Deserts can be scorching by day and bitterly cold by night because dry air holds little heat.
Rainforests shelter more species than any other habitat, many of them still undescribed.
Conservation requires protecting habitats, reducing pollution, and understanding how ecosystems
depend on each other.
"""


def default_cache_root() -> Path:
    """`$SUPERINFER_CACHE`, else `~/.cache/superinfer`."""
    env = os.environ.get("SUPERINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "superinfer"


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    if tok.get_vocab_size() != TINY_VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise RuntimeError(f"tiny tokenizer trained to {tok.get_vocab_size()} tokens; the corpus is too small")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok.to_str(pretty=True)


def tiny_tokenizer() -> Tokenizer:
    """A fresh `tokenizers.Tokenizer` of the tiny model (trained once per process, ~0.1 s)."""
    return Tokenizer.from_str(_tokenizer_json())


def special_token_ids() -> dict[str, int]:
    tok = tiny_tokenizer()
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(dest: Path) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; return the special ids."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(_tokenizer_json())
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_json(
        dest / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": BOS,
            "eos_token": EOT,
            "pad_token": PAD,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 4096,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return special_token_ids()


def tiny_config_dict() -> dict[str, Any]:
    """config.json of the tiny model, in the transformers 5 form."""
    ids = special_token_ids()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[END_OF_TEXT], ids[EOT]],
        "pad_token_id": ids[PAD],
    }


def write_tiny_model(dest: Path) -> None:
    """Write the whole tiny model folder into `dest` (created if needed)."""
    dest.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(dest)
    raw = tiny_config_dict()
    _write_json(dest / "config.json", raw)
    _write_json(
        dest / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": [ids[END_OF_TEXT], ids[EOT]], "pad_token_id": ids[PAD]},
    )
    model = DecoderLM(ModelConfig.from_dict(raw))
    init_random_weights(model, seed=TINY_SEED)
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.checkpoint_tensors()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})


def ensure_tiny_model(root: Path | None = None) -> Path:
    """Path of the tiny model folder under `root` (default cache), building it first if missing.

    The folder appears atomically (built in a temporary sibling, then renamed), so concurrent
    callers either see a complete folder or build their own copy and discard it.
    """
    root = Path(root) if root is not None else default_cache_root()
    target = root / TINY_DIRNAME
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_DIRNAME}-", dir=root))
    try:
        write_tiny_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
