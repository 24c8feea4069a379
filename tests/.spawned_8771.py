import runpy, sys
runpy.run_path('/work/wt/testtime/examples/imagenet/train_imagenet.py', run_name="__main__")
