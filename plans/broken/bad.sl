# plans/broken/bad.sl — a plan with a mistake, for the README's example of a diagnostic (SL104).
# Model: examples/llama.py
mesh world = auto[dp=auto, tp=2]

parallelize layers.* on world.tp {
    # `colwise`, misspelt:
    attention.{wq,wk,wv} : colwse
}
