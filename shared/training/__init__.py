"""Training the tiny models' weights (``pdmesh make-tiny-model --train`` / ``--train-mtp``).

The trainers run the serving model's own forward, made differentiable, and the engine to
measure what they trained, so this package sits above ``engine`` (and ``models``), beside
nothing the engine imports:

    trainable   the serving forward made differentiable; trained weights written back in
                the checkpoint's own layout
    lm          next-token training of a tiny model's decoder on the local corpus
    mtp         distilling its MTP layer from the model's own greedy continuations
"""
