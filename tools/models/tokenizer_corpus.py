"""A procedural training corpus for the built-in tokenizer.

The tokenizer of the built-in checkpoint must come out byte for byte the same on every machine,
so its training text is generated here from a seed instead of read from files that differ between
machines. The text mixes English-like prose from templates, invented words (so a 32k vocabulary
has enough distinct words to merge), numbers, code, JSON, chat-like turns and short snippets in
other scripts, so the byte-level BPE sees the variety real prompts have.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

NOUNS = (
    "time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story fact "
    "month lot right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea kid body "
    "information school face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river mountain garden window "
    "server request token model memory page cache queue worker router engine kernel batch tensor layer "
    "network packet signal file folder record table market price value energy planet island forest "
    "machine language message letter picture music song bridge station train ticket bottle kitchen"
).split()
VERBS = (
    "be have do say get make go know take see come think look want give use find tell ask work seem "
    "feel try leave call keep let begin help talk turn start show hear play run move like live believe "
    "hold bring happen write provide sit stand lose pay meet include continue set learn change lead "
    "understand watch follow stop create speak read allow add spend grow open walk win offer remember "
    "love consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest "
    "raise pass sell require report decide pull compute allocate transfer decode schedule measure"
).split()
ADJECTIVES = (
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able local sure free better true whole clear recent "
    "strong special easy simple hard quiet bright dark warm cold heavy light fast slow careful quick "
    "happy silent ancient modern green blue red yellow empty full rare common random tiny"
).split()
ADVERBS = "quickly slowly carefully quietly often never always rarely soon today again almost finally".split()
DETERMINERS = "the a this that every each some any another no my your our their his her".split()
PREPOSITIONS = "in on at by with from into over under after before through across near behind".split()
CONJUNCTIONS = "and but because although while when if so since unless".split()
NAMES = "Alice Bob Carol David Emma Frank Grace Henry Iris Jack Karen Leo Maria Noah Olga Paul".split()
SYLLABLES = (
    "ka lo mi ra ve to sa ni po lu be da fe gi ho ju ke la me no pe qui re si tu va we xi yo za "
    "an en in on un ar er ir or ur al el il ol ul str pla tri gro chu sho pha the"
).split()
FOREIGN = (
    "Bonjour, comment allez-vous ? Je suis très content de vous voir.",
    "Das Wetter ist heute schön, und wir gehen später in den Park.",
    "¿Dónde está la estación de tren? Necesito comprar un billete.",
    "Привет, как дела? Сегодня хорошая погода.",
    "Καλημέρα, τι κάνεις σήμερα;",
    "今日は天気がいいですね。散歩に行きましょう。",
    "我们明天去图书馆看书，然后一起吃饭。",
    "오늘 날씨가 정말 좋네요. 같이 산책할까요?",
    "مرحبا، كيف حالك اليوم؟",
    "नमस्ते, आप कैसे हैं?",
    "Café, naïve, façade, jalapeño, Zürich, Ångström, smørrebrød.",
    "Emoji: 😀 🚀 🎉 ❤️ 👍🏽 🇯🇵 and symbols: € £ ¥ ± × ÷ → ∞ ≤ ≥ ✓",
)
CJK_CHARS = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
    "小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长"
    "知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最"
    "间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市"
    "眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计"
    "或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让"
    "认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办"
    "运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持"
    "取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞"
    "观争究包组造落视济喜离虽坏兴"
)
CODE_TEMPLATES = (
    "def {f}({a}, {b}):\n    \"\"\"{doc}\"\"\"\n    if {a} is None:\n        return {b}\n"
    "    return {a} + {b} * {n}\n",
    "for {a} in range({n}):\n    {b}.append({a} ** 2)\n",
    "class {C}:\n    def __init__(self, {a}: int = {n}) -> None:\n        self.{a} = {a}\n",
    "const {a} = await fetch(`/api/{f}?id=${{{b}}}`);\nconsole.log({a}.status, {n});\n",
    "{{\"{a}\": {n}, \"{b}\": \"{doc}\", \"ok\": true, \"items\": [{n}, {m}, null]}}\n",
    "SELECT {a}, COUNT(*) FROM {f} WHERE {b} > {n} GROUP BY {a};\n",
    "int {f}(int {a}) {{ return {a} < {n} ? {a} : {f}({a} - {m}); }}\n",
    "$ pdserve {f} --{a} {n} --{b}={m}\n",
    "<div class=\"{a}\"><p>{doc}</p></div>\n",
    "x_{n} = np.zeros(({n}, {m}), dtype=np.float32)  # {doc}\n",
)


def _invented_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _noun_phrase(rng: random.Random, vocab: list[str]) -> str:
    parts = [rng.choice(DETERMINERS)]
    if rng.random() < 0.5:
        parts.append(rng.choice(ADJECTIVES))
    parts.append(rng.choice(NOUNS) if rng.random() < 0.6 else rng.choice(vocab))
    return " ".join(parts)


def _sentence(rng: random.Random, vocab: list[str]) -> str:
    subject = rng.choice(NAMES) if rng.random() < 0.3 else _noun_phrase(rng, vocab)
    verb = rng.choice(VERBS)
    verb = rng.choice((verb, verb + "s", verb + "ed", "will " + verb, "did not " + verb))
    words = [subject, verb, _noun_phrase(rng, vocab)]
    if rng.random() < 0.5:
        words += [rng.choice(PREPOSITIONS), _noun_phrase(rng, vocab)]
    if rng.random() < 0.3:
        words.insert(2, rng.choice(ADVERBS))
    if rng.random() < 0.3:
        words += [rng.choice(CONJUNCTIONS), _noun_phrase(rng, vocab), rng.choice(VERBS) + "s"]
    text = " ".join(words)
    end = rng.choice(".....!?")
    if end == "?":
        text = "why did " + text
    return text[0].upper() + text[1:] + end


def _paragraph(rng: random.Random, vocab: list[str]) -> str:
    return " ".join(_sentence(rng, vocab) for _ in range(rng.randint(2, 6))) + "\n\n"


def _numbers(rng: random.Random, vocab: list[str]) -> str:
    return rng.choice((
        f"In {rng.randint(1900, 2030)}, {rng.randint(2, 999)} {rng.choice(NOUNS)}s cost "
        f"${rng.randint(1, 9999)}.{rng.randint(0, 99):02d} ({rng.randint(1, 100)}% more).\n",
        f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(1990, 2030)} "
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} - {rng.choice(vocab)} #{rng.randint(1, 10**6)}\n",
        f"{rng.random() * 1000:.3f} + {rng.randint(-500, 500)} = {rng.uniform(-1e4, 1e4):.2f}; "
        f"ratio {rng.randint(1, 9)}:{rng.randint(1, 9)}, v{rng.randint(0, 9)}.{rng.randint(0, 20)}\n",
    ))


def _code(rng: random.Random, vocab: list[str]) -> str:
    a, b = rng.sample(vocab, 2)
    f = "_".join(rng.sample(vocab, 2))
    return rng.choice(CODE_TEMPLATES).format(
        f=f, a=a, b=b, C=a.capitalize() + b.capitalize(), n=rng.randint(0, 4096),
        m=rng.randint(1, 64), doc=_sentence(rng, vocab).replace('"', "'"))


def _chat(rng: random.Random, vocab: list[str]) -> str:
    return (f"user: {_sentence(rng, vocab)}\nassistant: {_sentence(rng, vocab)} "
            f"{_sentence(rng, vocab)}\n\n")


def _foreign(rng: random.Random, vocab: list[str]) -> str:
    if rng.random() < 0.5:
        return rng.choice(FOREIGN) + "\n"
    chars = "".join(rng.choice(CJK_CHARS) for _ in range(rng.randint(4, 24)))
    return chars + rng.choice("。，！？") + "\n"


# (weight, generator); prose dominates, the rest keeps rarer byte patterns in the vocabulary.
_PIECES: tuple[tuple[int, Callable[[random.Random, list[str]], str]], ...] = (
    (10, _paragraph), (2, _numbers), (2, _code), (2, _chat), (1, _foreign),
)


def generate_corpus(num_bytes: int, seed: int = 0, invented_words: int = 20000) -> Iterator[str]:
    """Yield corpus documents until about `num_bytes` UTF-8 bytes have been produced.

    Same arguments, same text, on every machine: only Python's seeded `random.Random` is used
    (its sequence is stable across Python versions for the methods used here).
    """
    rng = random.Random(seed)
    vocab = sorted({_invented_word(rng) for _ in range(invented_words)})
    weights = [w for w, _ in _PIECES]
    makers = [m for _, m in _PIECES]
    produced = 0
    while produced < num_bytes:
        doc = "".join(rng.choices(makers, weights)[0](rng, vocab) for _ in range(8))
        produced += len(doc.encode("utf-8"))
        yield doc
