module smoe

go 1.19
