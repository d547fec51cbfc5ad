"""Common English words, each one token of the Qwen3.5 vocabulary both alone and after a space.

Text made of N of them joined by single spaces is exactly N tokens under the Qwen3.5 tokenizer (its
pre-tokenizer splits " word" pieces apart and each piece is one token), so the multi-turn dataset can ask
for a length in tokens without a tokenizer; under another vocabulary the count is approximate.
tests/test_bench_multi_turn.py checks the property against the real tokenizer.
"""

_TEXT = """
    able about above accept act add after again against age agree ahead air all allow almost alone along
    already also always amount and anger animal answer any appear apple area arm around arrive art ask
    attack away baby back bad bag ball bank base basket bear beat beautiful because bed bee before begin
    bell below belt bench best better between big bird birth bit bite black blade blood blue board boat
    body bone book border born both bottom box boy brain branch bread break brick bridge bright bring
    brown brush bucket build burn burst bus business busy button buy cake call camera camp can card care
    carry case cat catch cause cell chain chair chalk change cheap check chest chief child chin church
    circle city claim class clean clear clock close cloth cloud coal coat cold color comb come common
    company compare complete copy cord corn correct cost count country cover cow credit crime cross cry
    cup current curve cut damage danger dark daughter day dead death deep degree design detail develop
    die different digest direction dirty discover dish distance divide do dog door double down drawer
    dream dress drink drive drop dry each ear early earth east easy eat edge effect egg eight either end
    enemy enter equal error even event ever every exact example except exchange exist expert eye face
    fact fall false family far farm fast fat father feed feel female few field fight figure fill film
    final find fine finger finish fire first fish fit five fix flag flat flight floor flower fly fold
    food foot force forest forget fork form forward four frame free fresh friend front fruit full future
    game gate general get gift girl give glass go gold good grass great green grey group grow guard
    guess guide gun hair half hall hammer hand hang happy hard hat have head health hear heart heat
    heavy help here high hill history hold hole home hook hope horn horse hospital hot hour house how
    human hunt hurt ice idea if ill image important inch increase industry ink inside instrument
    interest iron join judge jump keep key kick kind knife know land language large last late law lead
    leaf learn left leg lesson letter level library lift light like limit line lip liquid list listen
    little live lock long look loss loud love low machine main make male man manager map mark market
    mass match matter meal measure medical meet memory metal middle mind mine minute mist mix model
    money monkey month moon mother motion mouth move much music name nation natural near neck need
    needle net new news night nine noise none normal north nose note notice number nut object odd offer
    office oil old one only open orange order other out oven over owner page pain paint paper parcel
    part party pass past paste pay peace pen people person picture piece pig pin pipe place plane plant
    plate play please point porter position possible pot power present price print private problem
    process produce profit property public pull purpose push put quality question quick quiet quite rail
    rain range rat rate ray reach read ready reason receipt record red regular relation report request
    rest reward rice right ring river road rod roll roof room root rough round row rub rule run sad safe
    salt same sand say scale school science sea seat second secret see seed self send sense serious
    seven sex shade shake sharp shelf ship shirt short side sign silver simple size skin sky sleep slope
    slow small smooth snake snow soap sock soft solid some son song sort sound soup south space special
    spring square stage stamp star start statement station steam steel stem step stick still stone stop
    store story straight street stretch strong structure summer sun support sweet system table tail take
    talk tax test theory thin thing thought thread throat through thumb ticket tight time tin top touch
    town trade train transport tree true turn two under unit up use value verse very view violent voice
    wait walk wall war warm wash watch water wave way weather week weight well west wet wheel when where
    while white who why wide will wind window wine wing winter wire wise with woman wood word work worm
    writing wrong year yellow yes young
"""
WORDS: tuple[str, ...] = tuple(_TEXT.split())
