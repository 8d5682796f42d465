"""`data=petastorm`: Parquet (as Spark, pandas or Petastorm write it) read in equal shares.

source  what is on storage: files, row groups, the columns' types across all files, filters
plan    which rows each rank reads in an epoch, in which order (from the metadata alone)
reader  reads the planned row groups through Petastorm's workers, back in plan order
data    cuts them into batches: the trainer's TrainData and EvalData
"""
