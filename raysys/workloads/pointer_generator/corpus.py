"""A synthetic clinical-note corpus whose summaries must *copy* entities from the note.

The original trained on MIMIC-IV-BHC (credentialed, not available here). Each note here has the
sections of a discharge note (admission, history, medications with doses, labs with values, dates,
hospital course, discharge medications) padded with routine sentences that a summary leaves out.
Its reference summary states the admission, the problem, the medications, the notable labs and
the discharge, *paraphrasing* the note's wording (e.g. "shortness of breath" -> "dyspnea",
"twice daily" -> "BID") and *copying* its entities verbatim: drug names, doses, dates, lab values.

Drug names are drawn from ~40,000 made-up names and every number is random, so almost every
entity of a held-out note was never seen in training: a model can only get them right by copying
(the point of the pointer-generator), not by memorising. Deterministic in ``seed``.
"""

from __future__ import annotations

import datetime as dt
from typing import Iterator

import numpy as np

_ONSET = ["bo", "ca", "da", "fe", "ga", "he", "ki", "lo", "me", "ni", "pa", "qui", "ro", "sa", "te", "va",
          "xe", "zo", "tri", "cla", "pro", "bri", "dro", "flu", "gly", "ste", "ple", "cra", "vo", "mu"]
_MIDDLE = ["la", "ren", "xi", "vo", "tam", "zo", "pri", "lu", "dex", "mo", "ne", "ti", "ba", "co", "ri", "sta",
           "ga", "fi", "qua", "pe", "do", "ven", "li", "ro", "su", "ka", "pa", "mi", "tu", "ze"]
_SUFFIX = ["mab", "nib", "pril", "sartan", "olol", "statin", "azole", "cillin", "mycin", "pine", "zepam",
           "tidine", "formin", "gliptin", "parin", "oxacin", "vir", "triptan", "dronate", "lukast",
           "setron", "profen", "caine", "thiazide", "semide", "done", "barb", "zumab", "lamide", "ridone",
           "ximab", "tinib", "afil", "oxetine", "apine", "etine", "amide", "ine", "ol", "ex", "an", "il",
           "one"]

# (the note's words, the summary's words): the summary paraphrases, it does not copy these
_PROBLEMS = [("shortness of breath", "dyspnea"), ("chest pain", "angina"), ("high blood pressure", "hypertension"),
             ("a fast heart rate", "tachycardia"), ("a slow heart rate", "bradycardia"), ("low blood sugar", "hypoglycemia"),
             ("high blood sugar", "hyperglycemia"), ("kidney injury", "AKI"), ("a lung infection", "pneumonia"),
             ("a urinary infection", "UTI"), ("a blood clot in the leg", "DVT"), ("a blood clot in the lung", "PE"),
             ("fainting", "syncope"), ("a seizure", "seizure activity"), ("abdominal pain", "abdominal pain"),
             ("vomiting blood", "hematemesis"), ("confusion", "altered mental status"), ("a stroke", "CVA"),
             ("heart failure", "CHF exacerbation"), ("a skin infection", "cellulitis")]
_HISTORY = [("diabetes", "DM2"), ("high cholesterol", "HLD"), ("heart failure", "CHF"), ("kidney disease", "CKD"),
            ("atrial fibrillation", "AFib"), ("asthma", "asthma"), ("COPD", "COPD"), ("a prior stroke", "prior CVA"),
            ("coronary disease", "CAD"), ("hypothyroidism", "hypothyroidism"), ("obesity", "obesity"),
            ("depression", "depression")]
_FREQ = [("once daily", "daily"), ("twice daily", "BID"), ("three times daily", "TID"), ("every night", "QHS"),
         ("every eight hours", "q8h"), ("as needed", "PRN"), ("every morning", "QAM")]
_LABS = [("creatinine", "mg/dL", 0.4, 6.0, 1), ("potassium", "mEq/L", 2.5, 6.5, 1), ("sodium", "mEq/L", 120, 150, 0),
         ("hemoglobin", "g/dL", 5.0, 17.0, 1), ("white count", "K/uL", 1.0, 30.0, 1), ("glucose", "mg/dL", 40, 500, 0),
         ("troponin", "ng/mL", 0.01, 9.0, 2), ("lactate", "mmol/L", 0.5, 9.0, 1), ("INR", "", 0.8, 6.0, 1),
         ("platelets", "K/uL", 20, 600, 0), ("BNP", "pg/mL", 20, 4000, 0), ("magnesium", "mg/dL", 1.0, 3.5, 1)]
_ROUTINE = [
    "The patient was seen by physical therapy and cleared for discharge home.",
    "Nursing notes document that the patient ate well and ambulated in the hallway.",
    "Social work met with the family to discuss home services.",
    "Vital signs were stable throughout the remainder of the stay.",
    "The patient denied fevers, chills, nausea or diarrhea on review of systems.",
    "Code status was confirmed as full code with the patient and family.",
    "Diet was advanced as tolerated without difficulty.",
    "A chest x-ray showed no acute process.",
    "The patient was counseled on smoking cessation.",
    "Pain was well controlled on the current regimen.",
    "Telemetry showed no significant events overnight.",
    "The patient slept well and had no complaints in the morning.",
    "Deep vein thrombosis prophylaxis was given during the admission.",
    "Occupational therapy recommended a shower chair at home.",
    "The physical exam was otherwise unremarkable.",
    "Follow up was arranged with the primary care physician.",
]


def drug_name(rng: np.random.Generator) -> str:
    parts = [_ONSET[rng.integers(len(_ONSET))], _MIDDLE[rng.integers(len(_MIDDLE))], _SUFFIX[rng.integers(len(_SUFFIX))]]
    return "".join(parts)


def _date(rng: np.random.Generator, base: dt.date, spread: int) -> dt.date:
    return base + dt.timedelta(days=int(rng.integers(0, spread)))


def _dose(rng: np.random.Generator) -> str:
    return f"{int(rng.choice([1, 2, 5, 10, 12, 20, 25, 40, 50, 75, 100, 125, 150, 200, 250, 300, 500, 750, 1000]))} mg"


def _value(rng: np.random.Generator, lo: float, hi: float, decimals: int) -> str:
    v = rng.uniform(lo, hi)
    return f"{v:.{decimals}f}" if decimals else str(int(round(v)))


def make_example(rng: np.random.Generator) -> dict:
    """One (note, summary, entities) triple; ``entities`` are the summary's copied strings."""
    admit = _date(rng, dt.date(2125, 1, 1), 3650)
    discharge = admit + dt.timedelta(days=int(rng.integers(1, 15)))
    age, sex = int(rng.integers(19, 96)), ["man", "woman"][rng.integers(2)]
    problem, problem_short = _PROBLEMS[rng.integers(len(_PROBLEMS))]
    hist = [_HISTORY[i] for i in rng.choice(len(_HISTORY), size=int(rng.integers(1, 4)), replace=False)]
    days = int(rng.integers(1, 10))
    meds = [(drug_name(rng), _dose(rng), _FREQ[rng.integers(len(_FREQ))]) for _ in range(int(rng.integers(2, 5)))]
    new = (drug_name(rng), _dose(rng), _FREQ[rng.integers(len(_FREQ))])
    labs = [(_LABS[i], _value(rng, *_LABS[i][2:])) for i in rng.choice(len(_LABS), size=int(rng.integers(2, 5)), replace=False)]
    lab_date = _date(rng, admit, max(1, (discharge - admit).days))
    stopped = meds[rng.integers(len(meds))]
    routine = list(rng.choice(len(_ROUTINE), size=int(rng.integers(4, 9)), replace=False))

    def lab_text(lab, value, long: bool) -> str:
        (name, unit, *_), = [lab]
        return f"{name} of {value} {unit}".strip() if long else f"{name} {value}".strip()

    note = [
        f"Admission Date: {admit.isoformat()} Discharge Date: {discharge.isoformat()}",
        f"History of Present Illness: {age} year old {sex} with a history of "
        f"{', '.join(h for h, _ in hist)} who presented with {problem} for {days} days.",
        *(_ROUTINE[i] for i in routine[: len(routine) // 2]),
        "Medications on Admission: " + "; ".join(f"{d} {dose} {f[0]}" for d, dose, f in meds) + ".",
        f"Pertinent Results: on {lab_date.isoformat()} labs showed "
        + ", ".join(lab_text(lab, v, True) for lab, v in labs) + ".",
        f"Hospital Course: the patient was treated for {problem} and started on {new[0]} {new[1]} {new[2][0]}. "
        f"{stopped[0]} was held during the admission.",
        *(_ROUTINE[i] for i in routine[len(routine) // 2:]),
        "Discharge Medications: " + "; ".join(f"{d} {dose} {f[0]}" for d, dose, f in [*meds, new] if d != stopped[0]) + ".",
    ]
    opener = ["{age} yo {sex} with {hist} admitted {admit} with {p}.",
              "{age}-year-old {sex} ({hist}) admitted on {admit} for {p}.",
              "Admitted {admit}: {age} yo {sex}, PMH {hist}, presenting with {p}."][rng.integers(3)]
    summary = [
        opener.format(age=age, sex="M" if sex == "man" else "F", hist=", ".join(s for _, s in hist), admit=admit.isoformat(),
                      p=problem_short),
        "Labs: " + ", ".join(lab_text(lab, v, False) for lab, v in labs) + ".",
        f"Started {new[0]} {new[1]} {new[2][1]}; {stopped[0]} held.",
        f"Discharged {discharge.isoformat()} on "
        + ", ".join(f"{d} {dose} {f[1]}" for d, dose, f in meds if d != stopped[0]) + f", {new[0]}.",
    ]
    entities = [admit.isoformat(), discharge.isoformat(), new[0], new[1], stopped[0],
                *(v for _, v in labs), *(d for d, _, _ in meds), *(dose for d, dose, _ in meds if d != stopped[0])]
    return {"note": "\n".join(note), "summary": "\n".join(summary), "entities": sorted(set(entities))}


def generate(n: int, seed: int) -> Iterator[dict]:
    """``n`` examples; the same ``seed`` gives the same corpus on every machine."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield make_example(rng)
