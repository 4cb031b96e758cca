"""The fixed-shape mode of the sparse half (train.cuda_graph=on): the padded lookup plans and the
owner's fixed-size sum (padded.py), and the step's stages in fixed shapes (shapes.py: FixedShapes)."""
